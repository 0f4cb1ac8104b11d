// client/cpp's BufferPlan and EngineBuffers with and without the coarse level: the
// coarse buffers only with one, after flags (the other offsets unchanged), and their
// accessors on the plan's offsets. Host memory only.
#include "client/cpp/buffer_plan.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>

#include "client/cpp/engine_buffers.h"
#include "gtest/gtest.h"

namespace eps::client {
namespace {

ModelLayout Model(int coarse_blocks) {
  ModelLayout m;
  m.num_layers = 3;
  m.num_q_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 32;
  m.group_blocks = 2;
  m.coarse_blocks = coarse_blocks;
  return m;
}

BufferShape Shape(int64_t coarse_slots) {
  BufferShape s;
  s.num_slots = 40;
  s.max_seqs = 3;
  s.max_context = 1000;  // 63 blocks: 32 groups, 8 coarse groups of 8 blocks
  s.max_batch = 2;
  s.coarse_slots = coarse_slots;
  return s;
}

TEST(BufferPlanTest, WithoutACoarseLevelThereAreNoCoarseBuffers) {
  absl::StatusOr<BufferPlan> plan = BufferPlan::For(Model(0), Shape(0));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->ElementsOf(SharedBuffer::kCoarsePool), 0);
  EXPECT_EQ(plan->ElementsOf(SharedBuffer::kCoarseTable), 0);
  EXPECT_EQ(plan->max_coarse_groups, 0);
  const v1::SharedBuffers d = plan->Descriptors(v1::MemoryDescriptor());
  EXPECT_FALSE(d.has_coarse_pool());
  EXPECT_FALSE(d.has_coarse_table());
  EXPECT_TRUE(d.has_flags());
}

TEST(BufferPlanTest, CoarseBuffersComeAfterFlagsAndLeaveTheOtherOffsetsAlone) {
  const BufferPlan flat = *BufferPlan::For(Model(0), Shape(0));
  absl::StatusOr<BufferPlan> plan = BufferPlan::For(Model(8), Shape(24));
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (int i = 0; i <= static_cast<int>(SharedBuffer::kFlags); ++i) {
    EXPECT_EQ(plan->offsets[i], flat.offsets[i]) << kBufferContract[i].name;
    EXPECT_EQ(plan->elements[i], flat.elements[i]) << kBufferContract[i].name;
  }
  EXPECT_EQ(plan->max_coarse_groups, 8);
  EXPECT_GE(plan->coarse_pool, flat.size);
  EXPECT_EQ(plan->coarse_pool % kBufferAlignment, 0u);
  EXPECT_EQ(plan->ElementsOf(SharedBuffer::kCoarsePool), 24 * 3 * 2 * plan->record_words);
  EXPECT_EQ(plan->ElementsOf(SharedBuffer::kCoarseTable), 3 * 8);
  EXPECT_GT(plan->coarse_table, plan->coarse_pool);
  EXPECT_GE(plan->size, plan->coarse_table + 3 * 8 * 4);
  const v1::SharedBuffers d = plan->Descriptors(v1::MemoryDescriptor());
  ASSERT_TRUE(d.has_coarse_pool() && d.has_coarse_table());
  EXPECT_EQ(d.coarse_pool().offset(), plan->coarse_pool);
  EXPECT_EQ(d.coarse_table().dtype(), v1::DTYPE_INT32);
  ASSERT_EQ(d.coarse_table().shape_size(), 2);
  EXPECT_EQ(d.coarse_table().shape(0), 3);
  EXPECT_EQ(d.coarse_table().shape(1), 8);
  EXPECT_EQ(d.coarse_pool().shape(0), 24);
}

TEST(BufferPlanTest, CoarseSlotsMustMatchTheLayout) {
  absl::StatusOr<BufferPlan> missing = BufferPlan::For(Model(8), Shape(0));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(missing.status().message(),
            "BufferShape.coarse_slots=0 with coarse_blocks=8: want >= 1 with a coarse level, 0 "
            "without");
  absl::StatusOr<BufferPlan> stray = BufferPlan::For(Model(0), Shape(5));
  EXPECT_EQ(stray.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(stray.status().message().find("coarse_slots=5 with coarse_blocks=0"),
            std::string::npos);
  absl::StatusOr<BufferPlan> bad_level = BufferPlan::For(Model(3), Shape(5));
  EXPECT_NE(bad_level.status().message().find("coarse_blocks=3"), std::string::npos);
}

TEST(EngineBuffersTest, CoarseAccessorsAddressThePlansCoarseBuffers) {
  auto made = EngineBuffers::Create(Model(8), Shape(24), "plan-test");
  ASSERT_TRUE(made.ok()) << made.status();
  EngineBuffers& b = **made;
  const BufferPlan& plan = b.plan();
  const auto* base = reinterpret_cast<const std::byte*>(b.summary_pool().data()) - plan.pool;
  EXPECT_EQ(reinterpret_cast<const std::byte*>(b.CoarseRecord(0, 0, 0).data()),
            base + plan.coarse_pool);
  EXPECT_EQ(b.CoarseRecord(23, 2, 1).size(), static_cast<size_t>(plan.record_words));
  EXPECT_EQ(reinterpret_cast<const std::byte*>(b.CoarseRecord(23, 2, 1).data()),
            base + plan.coarse_pool + plan.RecordIndex(23, 2, 1) * 4);
  EXPECT_EQ(reinterpret_cast<const std::byte*>(b.CoarseRow(2).data()),
            base + plan.coarse_table + 2 * 8 * 4);
  EXPECT_EQ(b.CoarseRow(2).size(), 8u);
  EXPECT_EQ(b.max_coarse_groups(), 8);

  auto flat = EngineBuffers::Create(Model(0), Shape(0), "plan-test");
  ASSERT_TRUE(flat.ok()) << flat.status();
  EXPECT_TRUE((*flat)->CoarseRecord(0, 0, 0).empty());
  EXPECT_TRUE((*flat)->CoarseRow(0).empty());
}

TEST(BufferPlanTest, FeedbackIsAbsentUnlessAskedForAndComesLast) {
  for (int coarse_blocks : {0, 8}) {
    const BufferShape without = Shape(coarse_blocks == 0 ? 0 : 24);
    EXPECT_FALSE(without.with_feedback);
    const BufferPlan base = *BufferPlan::For(Model(coarse_blocks), without);
    EXPECT_EQ(base.ElementsOf(SharedBuffer::kFeedback), 0);
    EXPECT_FALSE(base.Descriptors(v1::MemoryDescriptor()).has_feedback());
    BufferShape with = without;
    with.with_feedback = true;
    absl::StatusOr<BufferPlan> plan = BufferPlan::For(Model(coarse_blocks), with);
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (int i = 0; i < static_cast<int>(SharedBuffer::kFeedback); ++i) {
      EXPECT_EQ(plan->offsets[i], base.offsets[i]) << kBufferContract[i].name;
      EXPECT_EQ(plan->elements[i], base.elements[i]) << kBufferContract[i].name;
    }
    EXPECT_EQ(plan->feedback, base.size);
    EXPECT_EQ(plan->feedback % kBufferAlignment, 0u);
    EXPECT_EQ(plan->ElementsOf(SharedBuffer::kFeedback), 3 * 3 * 4 * 32);  // L, seqs, Hq, groups
    EXPECT_GE(plan->size, plan->feedback + 3 * 3 * 4 * 32 * 4);
    EXPECT_EQ(plan->FeedbackIndex(2, 1, 3), ((2 * 3 + 1) * 4 + 3) * 32);
    const v1::SharedBuffers d = plan->Descriptors(v1::MemoryDescriptor());
    ASSERT_TRUE(d.has_feedback());
    EXPECT_EQ(d.feedback().offset(), plan->feedback);
    EXPECT_EQ(d.feedback().dtype(), v1::DTYPE_FLOAT32);
    ASSERT_EQ(d.feedback().shape_size(), 4);
    EXPECT_EQ(d.feedback().shape(0), 3);
    EXPECT_EQ(d.feedback().shape(1), 3);
    EXPECT_EQ(d.feedback().shape(2), 4);
    EXPECT_EQ(d.feedback().shape(3), 32);
  }
}

TEST(EngineBuffersTest, FeedbackRowsAddressThePlansFeedbackAndStartNaN) {
  BufferShape shape = Shape(0);
  shape.with_feedback = true;
  auto made = EngineBuffers::Create(Model(0), shape, "plan-test");
  ASSERT_TRUE(made.ok()) << made.status();
  EngineBuffers& b = **made;
  const BufferPlan& plan = b.plan();
  const auto* base = reinterpret_cast<const std::byte*>(b.summary_pool().data()) - plan.pool;
  std::span<float> row = b.FeedbackRow(2, 1, 3);
  ASSERT_EQ(row.size(), 32u);
  EXPECT_EQ(reinterpret_cast<const std::byte*>(row.data()),
            base + plan.feedback + plan.FeedbackIndex(2, 1, 3) * 4);
  for (int layer = 0; layer < 3; ++layer) {
    for (int r = 0; r < 3; ++r) {
      for (int h = 0; h < 4; ++h) {
        for (float v : b.FeedbackRow(layer, r, h)) ASSERT_TRUE(std::isnan(v));
      }
    }
  }

  auto without = EngineBuffers::Create(Model(0), Shape(0), "plan-test");
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_TRUE((*without)->FeedbackRow(0, 0, 0).empty());
}

// A /dev/shm too small for the buffers (a container's default is 64 MiB): Create once
// succeeded on a sparse object and the NaN fill of the feedback buffer (or the engine's
// first write) died of SIGBUS. In a child process with a mount namespace of its own whose
// /dev/shm is a 1 MiB tmpfs; skipped where the process may not make one (not root).
TEST(EngineBuffersTest, ADevShmTooSmallIsAnErrorNotASigbus) {
  constexpr int kNoNamespace = 77;
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (unshare(CLONE_NEWNS) != 0 || mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) ||
        mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=1m") != 0) {
      _exit(kNoNamespace);
    }
    BufferShape shape = Shape(0);
    shape.num_slots = 4000;
    shape.with_feedback = true;
    absl::StatusOr<BufferPlan> plan = BufferPlan::For(Model(0), shape);
    if (!plan.ok() || plan->size < (4 << 20)) _exit(2);  // the test's own shape is wrong
    auto made = EngineBuffers::Create(Model(0), shape, "plan-test");
    const bool refused = !made.ok() &&
                         made.status().code() == absl::StatusCode::kResourceExhausted &&
                         made.status().message().find("/dev/shm") != std::string::npos;
    if (!refused) std::fprintf(stderr, "Create: %s\n", made.status().ToString().c_str());
    _exit(refused ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_FALSE(WIFSIGNALED(status)) << "the child died of signal " << WTERMSIG(status);
  if (WEXITSTATUS(status) == kNoNamespace) GTEST_SKIP() << "no mount namespace here (not root?)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "Create did not refuse with RESOURCE_EXHAUSTED";
}

TEST(BufferPlanTest, ShapesPastEpsdsLimitsAreRefusedNamingTheField) {
  // A plan once wrapped int64: 2^62 slots' records made a 1536-byte allocation, and
  // Create succeeded with every Record past the first few outside the mapping.
  BufferShape slots = Shape(0);
  slots.num_slots = int64_t{1} << 62;
  absl::StatusOr<BufferPlan> plan = BufferPlan::For(Model(0), slots);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("BufferShape.num_slots=4611686018427387904"),
            std::string::npos)
      << plan.status();
  EXPECT_FALSE(EngineBuffers::Create(Model(0), slots, "plan-test").ok());

  BufferShape context = Shape(0);
  context.max_context = int64_t{1} << 62;
  plan = BufferPlan::For(Model(0), context);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("BufferShape.max_context="), std::string::npos)
      << plan.status();

  BufferShape seqs = Shape(0);
  seqs.max_seqs = int64_t{1} << 40;
  EXPECT_NE(BufferPlan::For(Model(0), seqs).status().message().find("BufferShape.max_seqs="),
            std::string::npos);
  BufferShape batch = Shape(0);
  batch.max_batch = 0;
  EXPECT_NE(BufferPlan::For(Model(0), batch).status().message().find("BufferShape.max_batch=0"),
            std::string::npos);
}

TEST(BufferPlanTest, FieldsWithinTheirLimitsThatMultiplyPastInt64AreRefused) {
  // 2^31-1 rows of 2^31-1 blocks: every field is within its own bound, the block table is
  // 2^62 int32 entries, 2^64 bytes.
  BufferShape shape = Shape(0);
  shape.max_seqs = (int64_t{1} << 31) - 1;
  shape.max_context = ((int64_t{1} << 31) - 1) * 16;
  absl::StatusOr<BufferPlan> plan = BufferPlan::For(Model(0), shape);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("past 2^63 bytes"), std::string::npos) << plan.status();
}

TEST(EngineBuffersTest, AccessorsGiveEmptySpansOutsideTheShape) {
  auto made = EngineBuffers::Create(Model(8), Shape(24), "plan-test");
  ASSERT_TRUE(made.ok()) << made.status();
  EngineBuffers& b = **made;
  EXPECT_FALSE(b.Record(39, 2, 1).empty());
  EXPECT_TRUE(b.Record(40, 0, 0).empty());  // num_slots = 40
  EXPECT_TRUE(b.Record(-1, 0, 0).empty());
  EXPECT_TRUE(b.Record(0, 3, 0).empty());  // 3 layers
  EXPECT_TRUE(b.Record(0, 0, 2).empty());  // 2 KV heads
  EXPECT_TRUE(b.CoarseRecord(24, 0, 0).empty());
  EXPECT_TRUE(b.CoarseRow(3).empty());
  EXPECT_FALSE(b.GroupRow(2).empty());
  EXPECT_TRUE(b.GroupRow(3).empty());  // max_seqs = 3
  EXPECT_TRUE(b.GroupRow(-1).empty());
  EXPECT_TRUE(b.BlockRow(3).empty());
  EXPECT_FALSE(b.Query(2, 1, 3).empty());
  EXPECT_TRUE(b.Query(0, 2, 0).empty());  // max_batch = 2
  EXPECT_TRUE(b.Query(0, 0, 4).empty());  // 4 query heads
  EXPECT_TRUE(b.VisitBlocks(0, 2).empty());
  EXPECT_EQ(b.VisitCount(0, 2), -1);
  EXPECT_EQ(b.VisitCount(0, 0, 1), -1);  // union lists: one per (layer, batch position)
  EXPECT_FALSE(b.Visits(3, 0).has_value());
}

TEST(EngineBuffersTest, AttendDenselyIsNotAnEmptyListAndListsStayWithinTheirRow) {
  auto made = EngineBuffers::Create(Model(0), Shape(0), "plan-test");
  ASSERT_TRUE(made.ok()) << made.status();
  EngineBuffers& b = **made;
  const BufferPlan& plan = b.plan();
  // visit_count is epsd's to write; the test writes it through the mapping.
  auto* base = reinterpret_cast<std::byte*>(b.summary_pool().data()) - plan.pool;
  int32_t* count = reinterpret_cast<int32_t*>(base + plan.count);
  count[plan.ListIndex(0, 0, 0)] = -1;
  count[plan.ListIndex(0, 1, 0)] = 0;
  count[plan.ListIndex(1, 0, 0)] = 1 << 30;  // far past max_blocks = 63
  EXPECT_FALSE(b.Visits(0, 0).has_value());
  EXPECT_TRUE(b.VisitBlocks(0, 0).empty());
  ASSERT_TRUE(b.Visits(0, 1).has_value());
  EXPECT_TRUE(b.Visits(0, 1)->empty());
  ASSERT_TRUE(b.Visits(1, 0).has_value());
  EXPECT_EQ(b.Visits(1, 0)->size(), static_cast<size_t>(plan.max_blocks));
  EXPECT_EQ(b.VisitBlocks(1, 0).size(), static_cast<size_t>(plan.max_blocks));
}

// A crashed engine restarted in its container often gets its old pid back while /dev/shm
// still holds the object it left: the name Create would choose is taken. Create chose
// another name and left that object alone (before, it failed with "File exists").
TEST(EngineBuffersTest, ANameADeadProcessLeftBehindIsLeftAloneAndAnotherChosen) {
  auto first = EngineBuffers::Create(Model(0), Shape(0), "stale-name");
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string name = (*first)->shm_name();  // /eps-stale-name-<pid>-<n>
  const size_t dash = name.rfind('-');
  const std::string next =
      name.substr(0, dash + 1) + std::to_string(std::stoi(name.substr(dash + 1)) + 1);
  const int stale = shm_open(next.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(stale, 0) << next << ": " << std::strerror(errno);
  ASSERT_EQ(ftruncate(stale, 4096), 0);
  close(stale);

  auto second = EngineBuffers::Create(Model(0), Shape(0), "stale-name");
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_NE((*second)->shm_name(), next);
  EXPECT_EQ((*second)->shm_name().rfind(next + "-", 0), 0u) << (*second)->shm_name();
  struct stat left {};
  const int kept = shm_open(next.c_str(), O_RDONLY, 0);
  ASSERT_GE(kept, 0) << "the other process's object was removed";
  EXPECT_EQ(fstat(kept, &left), 0);
  EXPECT_EQ(left.st_size, 4096);
  close(kept);
  shm_unlink(next.c_str());
}

}  // namespace
}  // namespace eps::client
