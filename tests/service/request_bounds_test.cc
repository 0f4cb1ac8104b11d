// Hardening, class 2: arithmetic and allocation sized by a request. Values near
// the integer limits are INVALID_ARGUMENT before any arithmetic can overflow;
// every allocation a request sizes is bounded by --max-session-bytes and
// --max-server-bytes (RESOURCE_EXHAUSTED naming the flag); a few hundred bytes
// of request never make epsd allocate gigabytes.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/service/epsd_process.h"
#include "tests/service/raw_calls.h"
#include "tests/service/test_engine.h"

namespace eps {
namespace {

using testing::EpsdProcess;
using testing::TestEngine;

// A byte count of a process's /proc status (`field` e.g. "VmHWM:"), 0 when unreadable.
uint64_t StatusBytes(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::stoull(line.substr(field.size())) * 1024;
  }
  return 0;
}

// Peak resident bytes (VmHWM) and resident bytes now (VmRSS).
uint64_t PeakRssBytes(pid_t pid) { return StatusBytes(pid, "VmHWM:"); }
uint64_t RssBytes(pid_t pid) { return StatusBytes(pid, "VmRSS:"); }

v1::MemoryDescriptor Inline(v1::DType dtype, std::vector<int64_t> shape) {
  v1::MemoryDescriptor d;
  d.set_dtype(dtype);
  for (int64_t s : shape) d.add_shape(s);
  d.mutable_inline_bytes();  // no data: epsd zero-fills the declared shape
  return d;
}

// A tiny message that asks for a large model: every buffer inline and empty.
v1::AttachRequest LargeModelAttach(const std::string& engine, int layers, int kv_heads, int d,
                                   int m, int64_t record_words) {
  v1::AttachRequest a;
  a.set_engine_id(engine);
  v1::ModelLayout* l = a.mutable_layout();
  l->set_num_layers(layers);
  l->set_num_q_heads(kv_heads);
  l->set_num_kv_heads(kv_heads);
  l->set_head_dim(d);
  l->set_block_size(16);
  l->set_group_blocks(1);
  l->set_sketch_dim(m);
  a.set_max_batch(1);
  a.mutable_options()->set_method(v1::METHOD_JL);  // minimal records: no quest part
  v1::SharedBuffers* b = a.mutable_buffers();
  *b->mutable_summary_pool() = Inline(v1::DTYPE_FLOAT32, {1, layers, kv_heads, record_words});
  *b->mutable_group_table() = Inline(v1::DTYPE_INT32, {1, 1});
  *b->mutable_block_table() = Inline(v1::DTYPE_INT32, {1, 1});
  *b->mutable_queries() = Inline(v1::DTYPE_FLOAT32, {layers, 1, kv_heads, d});
  *b->mutable_visit_blocks() = Inline(v1::DTYPE_INT32, {layers, 1, 1});
  *b->mutable_visit_count() = Inline(v1::DTYPE_INT32, {layers, 1});
  return a;
}

int64_t RecordWords(int layers, int kv_heads, int d, int m) {
  ModelLayout model;
  model.num_layers = layers;
  model.num_q_heads = kv_heads;
  model.num_kv_heads = kv_heads;
  model.head_dim = d;
  model.sketch_dim = m;
  model.features = {.key_sum = false, .principal = false, .quest = false};
  return SummaryLayout::For(model).record_words;
}

TEST(RequestSizedAllocation, AFewHundredBytesOfAttachNeverAllocateAGigabyte) {
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("bounds-phi"));
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  // 64 layers x 64 KV heads x d=1024 x m=64: a 1 GiB Φ bank for a ~200-byte message.
  const v1::AttachRequest attach =
      LargeModelAttach("engine-big", 64, 64, 1024, 64, RecordWords(64, 64, 1024, 64));
  ASSERT_LT(attach.ByteSizeLong(), 400u);
  v1::AttachResponse response;
  const grpc::Status status = testing::RawAttach(*stub, attach, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_NE(status.error_message().find("--max-session-bytes"), std::string::npos)
      << status.error_message();
  EXPECT_LT(PeakRssBytes(epsd->pid()), uint64_t{512} << 20);
  EXPECT_TRUE(epsd->Running());
}

TEST(RequestSizedAllocation, InlineBuffersBeyondTheSessionLimitAreResourceExhausted) {
  auto epsd =
      EpsdProcess::Start(testing::UniqueSocket("bounds-session"), {"--max-session-bytes=8388608"});
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  v1::AttachRequest attach =
      LargeModelAttach("engine-inline", 4, 8, 128, 8, RecordWords(4, 8, 128, 8));
  attach.set_max_batch(1024);  // queries [4, 1024, 8, 128] fp32 = 16 MiB inline
  *attach.mutable_buffers()->mutable_queries() = Inline(v1::DTYPE_FLOAT32, {4, 1024, 8, 128});
  *attach.mutable_buffers()->mutable_visit_blocks() = Inline(v1::DTYPE_INT32, {4, 1024, 1});
  *attach.mutable_buffers()->mutable_visit_count() = Inline(v1::DTYPE_INT32, {4, 1024});
  v1::AttachResponse response;
  const grpc::Status status = testing::RawAttach(*stub, attach, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_NE(status.error_message().find("--max-session-bytes=8388608"), std::string::npos)
      << status.error_message();
  EXPECT_NE(status.error_message().find("queries"), std::string::npos) << status.error_message();
}

TEST(RequestSizedAllocation, SessionsTogetherBeyondTheServerLimitAreResourceExhausted) {
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("bounds-server"),
                                 {"--max-session-bytes=33554432", "--max-server-bytes=50331648"});
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  auto attach = [&](const std::string& engine) {
    v1::AttachRequest a = LargeModelAttach(engine, 4, 8, 128, 8, RecordWords(4, 8, 128, 8));
    a.set_max_batch(1024);  // queries [4, 1024, 8, 128] fp32 = 16 MiB inline
    *a.mutable_buffers()->mutable_queries() = Inline(v1::DTYPE_FLOAT32, {4, 1024, 8, 128});
    *a.mutable_buffers()->mutable_visit_blocks() = Inline(v1::DTYPE_INT32, {4, 1024, 1});
    *a.mutable_buffers()->mutable_visit_count() = Inline(v1::DTYPE_INT32, {4, 1024});
    v1::AttachResponse response;
    return testing::RawAttach(*stub, a, &response);
  };
  ASSERT_TRUE(attach("engine-1").ok());
  ASSERT_TRUE(attach("engine-2").ok());
  const grpc::Status third = attach("engine-3");
  EXPECT_EQ(third.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << third.error_message();
  EXPECT_NE(third.error_message().find("--max-server-bytes=50331648"), std::string::npos)
      << third.error_message();
}

// The budgets charge a session's inline buffers only while it lives, so the memory must go
// back to the system when it ends. From the heap it did not always: the first large buffer
// freed raised glibc's mmap threshold to its size, and the next, smaller one then stayed in
// its arena after Detach (14 MiB more resident after these two sessions than before them).
TEST(RequestSizedAllocation, InlineBuffersGoBackToTheSystemWhenTheirSessionEnds) {
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("bounds-give-back"));
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  const uint64_t before = RssBytes(epsd->pid());
  ASSERT_GT(before, 0u);
  for (const int batch : {1024, 896}) {  // queries [4, batch, 8, 128] fp32: 16 MiB, 14 MiB
    v1::AttachRequest attach =
        LargeModelAttach("engine-inline", 4, 8, 128, 8, RecordWords(4, 8, 128, 8));
    attach.set_max_batch(batch);
    *attach.mutable_buffers()->mutable_queries() = Inline(v1::DTYPE_FLOAT32, {4, batch, 8, 128});
    *attach.mutable_buffers()->mutable_visit_blocks() = Inline(v1::DTYPE_INT32, {4, batch, 1});
    *attach.mutable_buffers()->mutable_visit_count() = Inline(v1::DTYPE_INT32, {4, batch});
    v1::AttachResponse attached;
    ASSERT_TRUE(testing::RawAttach(*stub, attach, &attached).ok()) << "batch " << batch;
    grpc::ClientContext context;
    v1::DetachRequest detach;
    detach.set_session_id(attached.session_id());
    v1::DetachResponse detached;
    // Detach answers once the session's memory is freed (no other call uses it).
    ASSERT_TRUE(stub->Detach(&context, detach, &detached).ok()) << "batch " << batch;
  }
  EXPECT_LT(RssBytes(epsd->pid()), before + (uint64_t{8} << 20))
      << "resident before the sessions: " << before;
}

// A sparse shm object of `bytes` (tmpfs takes ftruncate to any size for free), removed
// with the value.
class SparseShm {
 public:
  explicit SparseShm(uint64_t bytes)
      : name_("/eps-sparse-" + std::to_string(getpid()) + "-" + std::to_string(++count_)) {
    const int fd = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ok_ = fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes)) == 0;
    if (fd >= 0) close(fd);
  }
  ~SparseShm() { shm_unlink(name_.c_str()); }
  bool ok() const { return ok_; }
  // `attach` with every host_shm buffer moved into this object at its own offset.
  v1::AttachRequest Into(v1::AttachRequest attach, uint64_t bytes) const {
    const google::protobuf::Descriptor* d = v1::SharedBuffers::descriptor();
    for (int i = 0; i < d->field_count(); ++i) {
      const google::protobuf::FieldDescriptor* f = d->field(i);
      const google::protobuf::Reflection* r = attach.buffers().GetReflection();
      if (!r->HasField(attach.buffers(), f)) continue;  // absent buffers stay absent
      auto* buffer =
          static_cast<v1::MemoryDescriptor*>(r->MutableMessage(attach.mutable_buffers(), f));
      if (!buffer->has_host_shm()) continue;
      buffer->mutable_host_shm()->set_name(name_);
      buffer->mutable_host_shm()->set_size(bytes);
    }
    return attach;
  }

 private:
  static inline int count_ = 0;
  std::string name_;
  bool ok_ = false;
};

// An object of many GiB costs the engine nothing but took as much of epsd's address space
// (128 TiB of sparse objects once made every later large allocation of epsd fail): each
// object's size is charged to --max-session-mapped-bytes and --max-server-mapped-bytes
// before it is mapped.
TEST(RequestSizedAllocation, SparseShmObjectsBeyondTheMappedLimitsAreResourceExhausted) {
  auto epsd =
      EpsdProcess::Start(testing::UniqueSocket("bounds-mapped"),
                         {"--max-session-mapped-bytes=64G", "--max-server-mapped-bytes=100G"});
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  TestEngine engine(testing::SmallServiceModel(), 1, 256, 1, testing::TestSeed());
  constexpr uint64_t k60G = uint64_t{60} << 30, k80G = uint64_t{80} << 30;
  SparseShm first(k60G), second(k60G), big(k80G);
  ASSERT_TRUE(first.ok() && second.ok() && big.ok());
  v1::AttachResponse response;
  const grpc::Status too_big =
      testing::RawAttach(*stub, big.Into(engine.Attach("engine-big"), k80G), &response);
  EXPECT_EQ(too_big.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << too_big.error_message();
  EXPECT_NE(too_big.error_message().find("--max-session-mapped-bytes=68719476736"),
            std::string::npos)
      << too_big.error_message();
  const grpc::Status within =
      testing::RawAttach(*stub, first.Into(engine.Attach("engine-1"), k60G), &response);
  ASSERT_TRUE(within.ok()) << within.error_message();
  const grpc::Status beyond =
      testing::RawAttach(*stub, second.Into(engine.Attach("engine-2"), k60G), &response);
  EXPECT_EQ(beyond.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << beyond.error_message();
  EXPECT_NE(beyond.error_message().find("--max-server-mapped-bytes=107374182400"),
            std::string::npos)
      << beyond.error_message();
  EXPECT_TRUE(epsd->Running());
}

class RequestArithmetic : public ::testing::TestWithParam<int64_t> {};

TEST_P(RequestArithmetic, ContextTokensNearTheInt64LimitsAreInvalidArgument) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("bounds-ctx"));
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  TestEngine engine(testing::SmallServiceModel(), 1, 1024, 1, seed);
  engine.Fill(0, 0, 1024);
  v1::AttachResponse session;
  ASSERT_TRUE(testing::RawAttach(*stub, engine.Attach("engine-ctx"), &session).ok());
  const grpc::Status status = testing::RawStep(
      *stub, testing::StepRequest(session.session_id(), 1, {TestEngine::Row(0, GetParam())}));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find("context_tokens"), std::string::npos)
      << status.error_message();
  // The session is still served.
  EXPECT_TRUE(testing::RawStep(
                  *stub, testing::StepRequest(session.session_id(), 2, {TestEngine::Row(0, 1000)}))
                  .ok());
  EXPECT_TRUE(epsd->Running());
}

INSTANTIATE_TEST_SUITE_P(Limits, RequestArithmetic,
                         ::testing::Values(std::numeric_limits<int64_t>::max(),
                                           std::numeric_limits<int64_t>::max() - 1,
                                           std::numeric_limits<int64_t>::max() - 15,
                                           std::numeric_limits<int64_t>::min(), int64_t{-1},
                                           int64_t{0}));

}  // namespace
}  // namespace eps
