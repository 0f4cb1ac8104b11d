// The device summary writer against core/'s SummaryWriter on fresh random keys.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/phi.h"
#include "core/summary.h"
#include "gpu/step.h"
#include "gpu/stream_ops.h"
#include "gpu/summary.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/gpu/host_copy.h"
#include "tests/gpu/pending_error.h"

namespace eps {
namespace {

ModelLayout Model() {
  ModelLayout m;
  m.num_layers = 2;
  m.num_q_heads = 8;
  m.num_kv_heads = 2;
  m.head_dim = 128;
  m.phi_seed = 5;
  m.features = {.key_sum = true, .principal = true, .quest = true, .quest8 = true};
  return m;
}

// `got` holds the device writer's `records` records, `host` core's of the same appends: sums
// to float rounding (another order), quest and quest8 bit for bit, the principal pair cleared.
void ExpectRecordsMatch(const ModelLayout& m, const std::vector<float>& host,
                        const std::vector<float>& got, int records) {
  const SummaryLayout layout = SummaryLayout::For(m);
  for (int r = 0; r < records; ++r) {
    const float* want = host.data() + r * layout.record_words;
    const float* have = got.data() + r * layout.record_words;
    const float scale = want[layout.fro2];        // every Gram entry and sum is bounded by it
    for (int w = 0; w < layout.quest_min; ++w) {  // Gram, norms, count, key sum
      ASSERT_NEAR(have[w], want[w], 1e-5f * scale + 1e-5f) << "record " << r << " word " << w;
    }
    // quest: binary16 min and max of the same keys, rounded outward alike: exact.
    const std::span<const float> want_record(want, layout.record_words);
    const std::span<const float> have_record(have, layout.record_words);
    for (int i = 0; i < m.head_dim; ++i) {
      ASSERT_EQ(QuestMin(have_record, layout, i), QuestMin(want_record, layout, i))
          << "record " << r;
      ASSERT_EQ(QuestMax(have_record, layout, i), QuestMax(want_record, layout, i))
          << "record " << r;
    }
    // quest8: every step exact (a power-of-two scale), so bit for bit.
    ASSERT_EQ(Quest8Scale(have_record, layout), Quest8Scale(want_record, layout)) << "record " << r;
    for (int i = 0; i < m.head_dim; ++i) {
      ASSERT_EQ(Quest8MinCode(have_record, layout, i), Quest8MinCode(want_record, layout, i))
          << "record " << r << " channel " << i;
      ASSERT_EQ(Quest8MaxCode(have_record, layout, i), Quest8MaxCode(want_record, layout, i))
          << "record " << r << " channel " << i;
    }
    EXPECT_EQ(have[layout.principal + 2], 0.0f) << "appends clear the principal pair";
  }
}

class GpuSummaryTest : public ::testing::TestWithParam<DType> {};

TEST_P(GpuSummaryTest, DeviceWriterMatchesTheCoreWriter) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const ModelLayout m = Model();
  const DType dtype = GetParam();
  auto phi = PhiBank::Create(m.phi_seed, 2, 2, 128, 8);
  SummaryWriter host_writer(m, *phi);
  auto device_writer = gpu::DeviceSummaryWriter::Create(m, 0);
  ASSERT_TRUE(device_writer.ok()) << device_writer.status();
  const SummaryLayout layout = SummaryLayout::For(m);
  const int records = 12;
  std::vector<float> host(records * layout.record_words);
  for (int r = 0; r < records; ++r)
    EXPECT_TRUE(
        host_writer.Reset({host.data() + r * layout.record_words, size_t(layout.record_words)})
            .ok());
  float* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, host.size() * 4), cudaSuccess);
  ASSERT_EQ(::eps::testing::CopyToDeviceNow(device, host.data(), host.size() * 4), cudaSuccess);
  // Two rounds: a prefill of up to 128 keys per record, then single decode tokens.
  for (int round = 0; round < 2; ++round) {
    std::vector<std::vector<uint16_t>> narrow(records);
    std::vector<std::vector<float>> wide(records);
    std::vector<void*> device_keys;
    std::vector<gpu::KeyAppend> appends;
    for (int r = 0; r < records; ++r) {
      const int64_t count = round == 0 ? 1 + static_cast<int64_t>(rng() % 128) : 1;
      // Decode keys 300 times larger on odd records: quest8's scale grows, its codes requantize.
      const float grow = round == 1 && r % 2 == 1 ? 300.0f : 1.0f;
      wide[r] = testing::GaussianVector(rng, count * 128, grow * (1.0f + r % 3));
      if (dtype == DType::kFloat32 && r == records - 1) {
        // Channels whose quotient by the scale falls below the float range: their codes
        // follow their sign (core FoldQuest8), whichever key comes first.
        wide[r][0] = 6e4f;
        wide[r][1] = -3e-43f;
        wide[r][count * 128 - 1] = 2e-44f;
      }
      const void* src = wide[r].data();
      size_t bytes = wide[r].size() * 4;
      if (dtype != DType::kFloat32) {
        for (float& x : wide[r]) {
          narrow[r].push_back(dtype == DType::kFloat16 ? FloatToHalf(x) : FloatToBFloat16(x));
          x = dtype == DType::kFloat16 ? HalfToFloat(narrow[r].back())
                                       : BFloat16ToFloat(narrow[r].back());
        }
        src = narrow[r].data();
        bytes = narrow[r].size() * 2;
      }
      void* keys = nullptr;
      ASSERT_EQ(cudaMalloc(&keys, bytes), cudaSuccess);
      ASSERT_EQ(::eps::testing::CopyToDeviceNow(keys, src, bytes), cudaSuccess);
      device_keys.push_back(keys);
      const int layer = r % 2, kvh = (r / 2) % 2;
      appends.push_back({device + r * layout.record_words, keys, count, 0, layer, kvh});
      ASSERT_TRUE(host_writer
                      .Append({host.data() + r * layout.record_words, size_t(layout.record_words)},
                              layer, kvh, {wide[r].data(), DType::kFloat32, count, 128})
                      .ok());
    }
    ASSERT_TRUE((*device_writer)->Append(appends, dtype).ok());
    for (void* k : device_keys) cudaFree(k);
  }
  std::vector<float> got(host.size());
  ASSERT_EQ(cudaMemcpy(got.data(), device, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(device);
  ExpectRecordsMatch(m, host, got, records);
}

INSTANTIATE_TEST_SUITE_P(KeyTypes, GpuSummaryTest,
                         ::testing::Values(DType::kFloat32, DType::kFloat16, DType::kBFloat16),
                         [](const auto& p) { return std::string(DTypeName(p.param)); });

TEST(GpuSummaryValidationTest, NonFiniteKeySkipsOnlyItsAppendAndDuplicatesAreRefused) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const ModelLayout m = Model();
  const SummaryLayout layout = SummaryLayout::For(m);
  auto writer = gpu::DeviceSummaryWriter::Create(m, 0);
  ASSERT_TRUE(writer.ok());
  float* records = nullptr;
  float* keys = nullptr;
  ASSERT_EQ(cudaMalloc(&records, 2 * layout.record_words * 4), cudaSuccess);
  ASSERT_EQ(cudaMemset(records, 0, 2 * layout.record_words * 4), cudaSuccess);
  std::vector<float> host_keys(2 * 128, 1.0f);
  host_keys[128 + 7] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_EQ(cudaMalloc(&keys, host_keys.size() * 4), cudaSuccess);
  ASSERT_EQ(::eps::testing::CopyToDeviceNow(keys, host_keys.data(), host_keys.size() * 4),
            cudaSuccess);
  const absl::Status status = (*writer)->Append(
      {{records, keys, 1, 0, 0, 0}, {records + layout.record_words, keys + 128, 1, 0, 0, 1}},
      DType::kFloat32);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("appends[1]"), std::string::npos) << status;
  EXPECT_NE(status.message().find("key 0 element 7 is nan"), std::string::npos) << status;
  std::vector<float> got(2 * layout.record_words);
  ASSERT_EQ(cudaMemcpy(got.data(), records, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got[layout.count], 1.0f) << "the good append applied";
  EXPECT_EQ(got[layout.record_words + layout.count], 0.0f) << "the bad append wrote nothing";
  EXPECT_EQ(
      (*writer)
          ->Append({{records, keys, 1, 0, 0, 0}, {records, keys, 1, 0, 0, 0}}, DType::kFloat32)
          .code(),
      absl::StatusCode::kInvalidArgument);
  cudaFree(records);
  cudaFree(keys);
}

// Device records of `words` floats each, freed with the fixture-less test.
struct DeviceRecords {
  explicit DeviceRecords(int64_t floats) {
    EXPECT_EQ(cudaMalloc(&data, floats * 4), cudaSuccess);
    EXPECT_EQ(cudaMemset(data, 0x5A, floats * 4), cudaSuccess);  // dirty: not a valid record
  }
  ~DeviceRecords() { cudaFree(data); }
  float* data = nullptr;
};

// The engine's stream is held by a wait (for epsd's lists, here for a host-mapped flag only
// a CPU store ends): a Reset and AppendAsync calls, as many as the writer has staging
// slots, queued behind it back to back, return while it still waits (a copy from pageable
// memory may wait for the stream), and once it runs they leave core's records.
TEST(GpuSummaryQueuedTest, CallsQueuedBehindAHeldStreamReturnAtOnceAndMatchTheCoreWriter) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const ModelLayout m = Model();
  const SummaryLayout layout = SummaryLayout::For(m);
  auto phi = PhiBank::Create(m.phi_seed, 2, 2, 128, 8);
  SummaryWriter host_writer(m, *phi);
  auto writer = gpu::DeviceSummaryWriter::Create(m, 0);
  ASSERT_TRUE(writer.ok()) << writer.status();
  // A Reset and kStagingSlots - 1 appends of 80 KiB each: every staging slot in flight.
  const int records = 2048, calls = gpu::DeviceSummaryWriter::kStagingSlots - 1;
  const int words = layout.record_words;
  std::vector<float> host(int64_t{records} * words);
  for (int r = 0; r < records; ++r) {
    ASSERT_TRUE(host_writer.Reset({host.data() + int64_t{r} * words, size_t(words)}).ok());
  }
  DeviceRecords pool(int64_t{records} * words);  // dirty until the queued Reset
  // Everything allocated and uploaded before the stream is held: keys [calls, records, d].
  const int d = m.head_dim;
  std::vector<float> keys = testing::GaussianVector(rng, int64_t{calls} * records * d, 1.0f);
  DeviceRecords device_keys(static_cast<int64_t>(keys.size()));
  ASSERT_EQ(::eps::testing::CopyToDeviceNow(device_keys.data, keys.data(), keys.size() * 4),
            cudaSuccess);
  std::vector<std::vector<gpu::KeyAppend>> appends(calls);
  for (int c = 0; c < calls; ++c) {
    for (int r = 0; r < records; ++r) {
      const int layer = r % 2, kvh = (r / 2) % 2;
      const float* k = device_keys.data + (int64_t{c} * records + r) * d;
      appends[c].push_back({pool.data + int64_t{r} * words, k, 1, 0, layer, kvh});
      ASSERT_TRUE(host_writer
                      .Append({host.data() + int64_t{r} * words, size_t(words)}, layer, kvh,
                              {keys.data() + (int64_t{c} * records + r) * d, DType::kFloat32, 1, d})
                      .ok());
    }
  }
  uint64_t* flag = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&flag), sizeof(uint64_t), cudaHostAllocMapped),
            cudaSuccess);
  *flag = 0;
  uint64_t* mapped = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped), flag, 0), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_TRUE(gpu::StreamWaitCounter(stream, mapped, 1).ok());
  // Ends the wait after 20 s should a call wait for the stream, so the test fails, not hangs.
  std::promise<void> issued;
  std::atomic<bool> guard_released{false};
  std::thread guard([&, done = issued.get_future()] {
    if (done.wait_for(std::chrono::seconds(20)) == std::future_status::timeout) {
      guard_released = true;
      __atomic_store_n(flag, uint64_t{1}, __ATOMIC_RELEASE);
    }
  });
  // The engine's own pending error survives calls that find staging slots still in flight
  // (a slot's "not ready" took it before).
  ASSERT_NO_FATAL_FAILURE(testing::LeaveErrorPending());
  std::vector<absl::Status> queued;
  queued.push_back((*writer)->Reset({{pool.data, records}}, stream));
  for (int c = 0; c < calls; ++c) {
    queued.push_back((*writer)->AppendAsync(appends[c], DType::kFloat32, stream, nullptr));
  }
  const cudaError_t callers = cudaGetLastError();
  const cudaError_t still_held = cudaStreamQuery(stream);
  (void)cudaGetLastError();  // cudaErrorNotReady is no error
  issued.set_value();
  guard.join();
  __atomic_store_n(flag, uint64_t{1}, __ATOMIC_RELEASE);
  EXPECT_FALSE(guard_released) << "a call waited for the held stream";
  EXPECT_EQ(still_held, cudaErrorNotReady) << "the stream was not held: this test checks nothing";
  EXPECT_EQ(callers, cudaErrorMemoryAllocation) << "the caller's pending error was taken";
  for (size_t i = 0; i < queued.size(); ++i) EXPECT_TRUE(queued[i].ok()) << i << ": " << queued[i];
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
  cudaFreeHost(flag);
  std::vector<float> got(host.size());
  ASSERT_EQ(cudaMemcpy(got.data(), pool.data, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  ExpectRecordsMatch(m, host, got, records);
}

TEST(GpuSummaryResetTest, ResetWritesTheBytesOfCoresReset) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  for (const bool quest8 : {false, true}) {
    ModelLayout m = Model();
    m.features.quest8 = quest8;
    const SummaryLayout layout = SummaryLayout::For(m);
    auto writer = gpu::DeviceSummaryWriter::Create(m, 0);
    ASSERT_TRUE(writer.ok()) << writer.status();
    const int per_slot = m.num_layers * m.num_kv_heads, words = layout.record_words;
    DeviceRecords pool(4 * per_slot * words);
    // slots 0 and 3 reset, 1 and 2 left dirty
    ASSERT_TRUE(
        (*writer)
            ->Reset({{pool.data + 3 * per_slot * words, per_slot}, {pool.data, per_slot}}, nullptr)
            .ok());
    ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
    std::vector<float> got(4 * per_slot * words), empty(words);
    ASSERT_EQ(cudaMemcpy(got.data(), pool.data, got.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_TRUE(ResetRecord(layout, empty).ok());
    for (int slot = 0; slot < 4; ++slot) {
      for (int r = 0; r < per_slot; ++r) {
        const bool same =
            std::memcmp(&got[(slot * per_slot + r) * words], empty.data(), words * 4) == 0;
        EXPECT_EQ(same, slot == 0 || slot == 3) << "quest8 " << quest8 << " slot " << slot;
      }
    }
  }
}

// A misaligned address is a sticky CUDA error that ends the context, and overlapping
// records (record + 4 words) have two warps race: all refused before anything is queued.
TEST(GpuSummaryValidationTest, MisalignedAndOverlappingAddressesAreRefused) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const ModelLayout m = Model();
  const SummaryLayout layout = SummaryLayout::For(m);
  auto writer = gpu::DeviceSummaryWriter::Create(m, 0);
  ASSERT_TRUE(writer.ok());
  DeviceRecords pool(3 * layout.record_words + 256);
  float* keys = pool.data + 2 * layout.record_words;
  auto refused = [&](const std::vector<gpu::KeyAppend>& appends, DType dtype,
                     const std::string& says) {
    const absl::Status s = (*writer)->Append(appends, dtype);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << says;
    EXPECT_NE(s.message().find(says), std::string::npos) << s;
    const absl::Status queued = (*writer)->AppendAsync(appends, dtype, nullptr, nullptr);
    EXPECT_EQ(queued.code(), absl::StatusCode::kInvalidArgument) << says;
  };
  refused({{pool.data + 1, keys, 1, 0, 0, 0}}, DType::kFloat32, "16-byte aligned");
  refused({{pool.data, reinterpret_cast<char*>(keys) + 2, 1, 0, 0, 0}}, DType::kFloat32,
          "aligned to its 4-byte");
  refused({{pool.data, reinterpret_cast<char*>(keys) + 1, 1, 0, 0, 0}}, DType::kFloat16,
          "aligned to its 2-byte");
  refused({{pool.data, keys, 1, 0, 0, 0}, {pool.data + 4, keys, 1, 0, 0, 1}}, DType::kFloat32,
          "overlaps");
  EXPECT_EQ((*writer)->Reset({{pool.data + 2, 1}}, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      (*writer)->Reset({{pool.data, 2}, {pool.data + layout.record_words, 1}}, nullptr).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "the context is still usable";
}

// core refuses an append once d * sum of squared norms >= FLT_MAX; the device writer skips
// it and says so, naming the key.
TEST(GpuSummaryValidationTest, KeysBeyondTheFloatRangeOfTheSumsAreSkippedAndNamed) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  ModelLayout m = Model();
  m.features = {.key_sum = true, .principal = false, .quest = false, .quest8 = false};
  const SummaryLayout layout = SummaryLayout::For(m);
  auto writer = gpu::DeviceSummaryWriter::Create(m, 0);
  ASSERT_TRUE(writer.ok());
  DeviceRecords pool(layout.record_words + 2 * 128);
  ASSERT_TRUE((*writer)->Reset({{pool.data, 1}}, nullptr).ok());
  std::vector<float> host(2 * 128, 1.0f);
  host[128 + 3] = 1.0e19f;  // key 1: (1e19)^2 * 128 > FLT_MAX
  float* keys = pool.data + layout.record_words;
  ASSERT_EQ(::eps::testing::CopyToDeviceNow(keys, host.data(), host.size() * 4), cudaSuccess);
  const absl::Status s = (*writer)->Append({{pool.data, keys, 2, 0, 0, 0}}, DType::kFloat32);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("key 1 brings"), std::string::npos) << s;
  EXPECT_NE(s.message().find("float range"), std::string::npos) << s;
  float count = -1.0f;
  cudaMemcpy(&count, pool.data + layout.count, 4, cudaMemcpyDeviceToHost);
  EXPECT_EQ(count, 0.0f);
}

// The synchronous Append shares its scratch between calls: two threads at once.
TEST(GpuSummaryValidationTest, SynchronousAppendsFromTwoThreadsAllLand) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const ModelLayout m = Model();
  const SummaryLayout layout = SummaryLayout::For(m);
  auto writer = gpu::DeviceSummaryWriter::Create(m, 0);
  ASSERT_TRUE(writer.ok());
  const int words = layout.record_words, calls = 200;
  DeviceRecords pool(2 * words + 128);
  ASSERT_TRUE((*writer)->Reset({{pool.data, 2}}, nullptr).ok());
  float* keys = pool.data + 2 * words;
  ASSERT_EQ(cudaMemset(keys, 0, 128 * 4), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<std::thread> threads;
  std::vector<int> failures(2, 0);
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      cudaSetDevice(0);
      cudaStream_t stream;
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      for (int c = 0; c < calls; ++c) {
        if (!(*writer)
                 ->Append({{pool.data + t * words, keys, 1, 0, 0, t}}, DType::kFloat32, stream)
                 .ok()) {
          ++failures[t];
        }
      }
      cudaStreamDestroy(stream);
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures, std::vector<int>(2, 0));
  for (int t = 0; t < 2; ++t) {
    float count = 0.0f;
    cudaMemcpy(&count, pool.data + t * words + layout.count, 4, cudaMemcpyDeviceToHost);
    EXPECT_EQ(count, static_cast<float>(calls)) << "thread " << t;
  }
}

// An error the caller left pending is not the writer's: Append and Reset checked their
// `<<<>>>` launches with cudaGetLastError, which reported it as theirs (and cleared it).
TEST(GpuSummaryValidationTest, ACallersPendingErrorIsNotReportedByAppendOrReset) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const ModelLayout m = Model();
  const SummaryLayout layout = SummaryLayout::For(m);
  ASSERT_NO_FATAL_FAILURE(testing::LeaveErrorPending());
  auto writer = gpu::DeviceSummaryWriter::Create(m, 0);
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);  // still the caller's, not taken
  DeviceRecords pool(layout.record_words + m.head_dim);
  float* keys = pool.data + layout.record_words;
  ASSERT_EQ(cudaMemset(keys, 0, m.head_dim * 4), cudaSuccess);
  ASSERT_NO_FATAL_FAILURE(testing::LeaveErrorPending());
  EXPECT_TRUE((*writer)->Reset({{pool.data, 1}}, nullptr).ok());
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
  ASSERT_NO_FATAL_FAILURE(testing::LeaveErrorPending());
  EXPECT_TRUE((*writer)->Append({{pool.data, keys, 1, 0, 0, 0}}, DType::kFloat32, nullptr).ok());
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
  unsigned long long* skipped = nullptr;
  ASSERT_EQ(cudaMalloc(&skipped, sizeof *skipped), cudaSuccess);
  ASSERT_EQ(cudaMemset(skipped, 0, sizeof *skipped), cudaSuccess);
  ASSERT_NO_FATAL_FAILURE(testing::LeaveErrorPending());
  EXPECT_TRUE((*writer)
                  ->AppendAsync({{pool.data, keys, 1, 0, 0, 0}}, DType::kFloat32, nullptr, skipped)
                  .ok());
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  float count = 0.0f;
  cudaMemcpy(&count, pool.data + layout.count, 4, cudaMemcpyDeviceToHost);
  EXPECT_EQ(count, 2.0f);  // both appends landed
  cudaFree(skipped);
}

// A failed call leaves no error of its own pending on the caller's thread: here an
// append refused on the device (a non-finite key), whose message reads the keys back.
TEST(GpuSummaryValidationTest, ARefusedAppendLeavesNoErrorPending) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const ModelLayout m = Model();
  const SummaryLayout layout = SummaryLayout::For(m);
  auto writer = gpu::DeviceSummaryWriter::Create(m, 0);
  ASSERT_TRUE(writer.ok()) << writer.status();
  DeviceRecords pool(layout.record_words + m.head_dim);
  ASSERT_TRUE((*writer)->Reset({{pool.data, 1}}, nullptr).ok());
  float* keys = pool.data + layout.record_words;
  std::vector<float> bad(m.head_dim, 1.0f);
  bad[3] = std::numeric_limits<float>::infinity();
  ASSERT_EQ(cudaMemcpy(keys, bad.data(), bad.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  const absl::Status s =
      (*writer)->Append({{pool.data, keys, 1, 0, 0, 0}}, DType::kFloat32, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  // An out-of-range device: the failed cudaSetDevice's error is the call's, not left behind.
  auto none = gpu::DeviceSummaryWriter::Create(m, 1 << 20);
  EXPECT_FALSE(none.ok());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

}  // namespace
}  // namespace eps
