// libeps_engine's C ABI (client/cpp/engine_capi.h) on a device: the summary queue
// applies exactly what the synchronous writer does and always raises its counter,
// a dense release queued on the engine's stream lands before that stream's wait,
// the watchdog releases a step that never completes and leaves a completed one
// alone, and the C entry points report bad arguments. Skips without a device.
#include "client/cpp/engine_capi.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/layout.h"
#include "core/phi.h"
#include "core/summary.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/client/engine_capi_fixture.h"
#include "tests/core/test_util.h"

namespace {

using eps::capi_testing::Addr;
using eps::capi_testing::EngineCapiTest;
using eps::capi_testing::ExpectRefused;

TEST_F(EngineCapiTest, SummaryQueueWritesWhatTheSynchronousWriterWrites) {
  const uint64_t seed = eps::testing::TestSeed();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  const int words = RecordWords(), records = 6, d = model_.head_dim, keys_per = 16;
  std::vector<float> host_keys(records * keys_per * d);
  for (float& k : host_keys) k = normal(rng);
  float* keys = Alloc<float>(host_keys.size());
  ASSERT_EQ(cudaMemcpy(keys, host_keys.data(), host_keys.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  float* sync_pool = Alloc<float>(records * words);
  float* queued_pool = Alloc<float>(records * words);
  std::vector<EpsKeyAppend> sync_appends, queued_appends;
  for (int r = 0; r < records; ++r) {
    const EpsKeyAppend a{Addr(sync_pool + r * words),
                         Addr(keys + r * keys_per * d),
                         keys_per,
                         0,
                         r % 2,
                         (r / 2) % 2};
    sync_appends.push_back(a);
    EpsKeyAppend b = a;
    b.record = Addr(queued_pool + r * words);
    queued_appends.push_back(b);
  }
  EpsSummaryWriter* writer = nullptr;
  ASSERT_EQ(eps_engine_summary_writer_create(&model_, 0, &writer), 0) << eps_engine_last_error();
  EpsSummaryQueue* queue = nullptr;
  ASSERT_EQ(eps_engine_summary_queue_create(writer, 0, &queue), 0) << eps_engine_last_error();
  ASSERT_EQ(eps_engine_summary_append(writer, sync_appends.data(), records, EPS_ENGINE_FLOAT32, 0),
            0)
      << eps_engine_last_error();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(eps_engine_summary_queue_submit(queue, queued_appends.data(), records,
                                            EPS_ENGINE_FLOAT32, Addr(stream), 7),
            0);
  ASSERT_EQ(eps_engine_summary_queue_wait(queue, Addr(stream), 7), 0);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // returns: the counter reached 7
  std::vector<float> a(records * words), b(records * words);
  cudaMemcpy(a.data(), sync_pool, a.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(b.data(), queued_pool, b.size() * 4, cudaMemcpyDeviceToHost);
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(std::memcmp(&a[i], &b[i], 4), 0) << "seed " << seed << " word " << i;
  }
  // Every feature of the C struct reached the writer: the quest8 part (bit-exact on the
  // device) equals core/'s.
  const eps::ModelLayout layout = Layout();
  const eps::SummaryLayout s = eps::SummaryLayout::For(layout);
  auto phi = eps::PhiBank::Create(layout.phi_seed, layout.num_layers, layout.num_kv_heads, d,
                                  layout.sketch_dim);
  ASSERT_TRUE(phi.ok());
  eps::SummaryWriter core(layout, *phi);
  for (int r = 0; r < records; ++r) {
    std::vector<float> want(words, 0.0f);  // zeroed, as the device pools here start
    ASSERT_TRUE(
        core.Append(want, r % 2, (r / 2) % 2,
                    {host_keys.data() + r * keys_per * d, eps::DType::kFloat32, keys_per, 0})
            .ok());
    for (int w = s.quest8; w < s.quest8 + d / 2 + 1; ++w) {
      ASSERT_EQ(std::memcmp(&a[r * words + w], &want[w], 4), 0) << "record " << r << " word " << w;
    }
  }
  EXPECT_EQ(eps_engine_summary_queue_errors(queue, nullptr, 0), 0u);
  eps_engine_summary_queue_destroy(queue);
  eps_engine_summary_writer_destroy(writer);
  cudaStreamDestroy(stream);
}

TEST_F(EngineCapiTest, FailedSubmissionsAreReportedCountedAndStillRaiseTheCounter) {
  const int words = RecordWords(), d = model_.head_dim;
  std::vector<float> host_key(d, 1.0f);
  host_key[3] = std::nanf("");
  float* key = Alloc<float>(d);
  cudaMemcpy(key, host_key.data(), d * 4, cudaMemcpyHostToDevice);
  float* pool = Alloc<float>(2 * words);
  EpsSummaryWriter* writer = nullptr;
  ASSERT_EQ(eps_engine_summary_writer_create(&model_, 0, &writer), 0);
  EpsSummaryQueue* queue = nullptr;
  ASSERT_EQ(eps_engine_summary_queue_create(writer, 0, &queue), 0);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // A non-finite key: skipped on the device, reported by the next drain (once), counted.
  const EpsKeyAppend nan_key{Addr(pool), Addr(key), 1, 0, 0, 0};
  ASSERT_EQ(
      eps_engine_summary_queue_submit(queue, &nan_key, 1, EPS_ENGINE_FLOAT32, Addr(stream), 3), 0);
  ASSERT_EQ(eps_engine_summary_queue_wait(queue, Addr(stream), 3), 0);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // returns: the counter reached 3
  EXPECT_EQ(eps_engine_summary_queue_drain(queue), 15);   // DATA_LOSS
  EXPECT_NE(std::string(eps_engine_last_error()).find("1 appends skipped"), std::string::npos)
      << eps_engine_last_error();
  EXPECT_NE(std::string(eps_engine_last_error()).find("float range"), std::string::npos)
      << eps_engine_last_error();
  EXPECT_EQ(eps_engine_summary_queue_drain(queue), 0) << "a skip is reported once";
  char message[512];
  EXPECT_EQ(eps_engine_summary_queue_errors(queue, message, sizeof(message)), 1u);
  EXPECT_NE(std::string(message).find("skipped"), std::string::npos) << message;
  std::vector<float> record(words);
  cudaMemcpy(record.data(), pool, words * 4, cudaMemcpyDeviceToHost);
  for (int i = 0; i < words; ++i) ASSERT_EQ(record[i], 0.0f) << "word " << i << " was written";
  // A malformed append (stride below head_dim): refused on the host and returned, nothing
  // queued but the counter.
  const EpsKeyAppend malformed{Addr(pool + words), Addr(key), 1, d - 1, 0, 0};
  EXPECT_EQ(
      eps_engine_summary_queue_submit(queue, &malformed, 1, EPS_ENGINE_FLOAT32, Addr(stream), 4),
      3);
  EXPECT_NE(std::string(eps_engine_last_error()).find("counter was raised"), std::string::npos)
      << eps_engine_last_error();
  ASSERT_EQ(eps_engine_summary_queue_wait(queue, Addr(stream), 4), 0);
  ASSERT_EQ(eps_engine_summary_queue_drain(queue), 0);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(eps_engine_summary_queue_errors(queue, message, sizeof(message)), 2u);
  EXPECT_NE(std::string(message).find("step 4"), std::string::npos) << message;
  EXPECT_NE(std::string(message).find("malformed"), std::string::npos) << message;
  eps_engine_summary_queue_destroy(queue);
  eps_engine_summary_writer_destroy(writer);
  cudaStreamDestroy(stream);
}

// The brief's trigger: a legal bf16 key beyond the binary16 range with quest on. The whole
// prefill run is skipped, so the group stays at count 0; drain must say so.
TEST_F(EngineCapiTest, ASkippedPrefillRunFailsTheNextDrain) {
  const int words = RecordWords(), d = model_.head_dim, keys = 32;
  std::vector<uint16_t> host(keys * d, eps::FloatToBFloat16(0.5f));
  host[5 * d + 9] = eps::FloatToBFloat16(1.0e5f);
  uint16_t* device_keys = Alloc<uint16_t>(host.size());
  ASSERT_EQ(cudaMemcpy(device_keys, host.data(), host.size() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  float* pool = Alloc<float>(words);
  EpsSummaryWriter* writer = nullptr;
  ASSERT_EQ(eps_engine_summary_writer_create(&model_, 0, &writer), 0);
  EpsSummaryQueue* queue = nullptr;
  ASSERT_EQ(eps_engine_summary_queue_create(writer, 0, &queue), 0);
  const EpsKeyAppend run{Addr(pool), Addr(device_keys), keys, 0, 1, 1};
  ASSERT_EQ(eps_engine_summary_queue_submit(queue, &run, 1, EPS_ENGINE_BFLOAT16, 0, 1), 0)
      << eps_engine_last_error();
  EXPECT_EQ(eps_engine_summary_queue_drain(queue), 15) << eps_engine_last_error();
  float count = -1.0f;
  cudaMemcpy(&count, pool + eps::SummaryLayout::For(Layout()).count, 4, cudaMemcpyDeviceToHost);
  EXPECT_EQ(count, 0.0f);
  eps_engine_summary_queue_destroy(queue);
  eps_engine_summary_writer_destroy(writer);
}

// Drain and the destructor wait for the newest submission: with a second stream, stream
// A's appends could land after the counter passed their step (or after the counter was freed).
TEST_F(EngineCapiTest, AQueueRefusesASecondStream) {
  const int words = RecordWords(), d = model_.head_dim;
  float* pool = Alloc<float>(words + d);
  EpsSummaryWriter* writer = nullptr;
  ASSERT_EQ(eps_engine_summary_writer_create(&model_, 0, &writer), 0);
  EpsSummaryQueue* queue = nullptr;
  ASSERT_EQ(eps_engine_summary_queue_create(writer, 0, &queue), 0);
  cudaStream_t a, b;
  ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  const EpsKeyAppend append{Addr(pool), Addr(pool + words), 1, 0, 0, 0};
  ASSERT_EQ(eps_engine_summary_queue_submit(queue, &append, 1, EPS_ENGINE_FLOAT32, Addr(a), 1), 0);
  ExpectRefused(eps_engine_summary_queue_submit(queue, &append, 1, EPS_ENGINE_FLOAT32, Addr(b), 2),
                "one stream per queue");
  ASSERT_EQ(eps_engine_summary_queue_submit(queue, &append, 1, EPS_ENGINE_FLOAT32, Addr(a), 2), 0);
  ASSERT_EQ(eps_engine_summary_queue_drain(queue), 0) << eps_engine_last_error();
  float count = 0.0f;
  cudaMemcpy(&count, pool + eps::SummaryLayout::For(Layout()).count, 4, cudaMemcpyDeviceToHost);
  EXPECT_EQ(count, 2.0f) << "the refused submission queued nothing";
  eps_engine_summary_queue_destroy(queue);
  eps_engine_summary_writer_destroy(writer);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

// A slot reused by a new group: reset (queued on the stream) then append equals a fresh
// record; without the reset the old group's statistics stayed (count 2, max_norm 141).
TEST_F(EngineCapiTest, ResetRecordsAreCoresEmptyRecordsAndAReusedSlotStartsFresh) {
  const eps::ModelLayout layout = Layout();
  const int words = RecordWords(), d = model_.head_dim;
  const int per_slot = layout.num_layers * layout.num_kv_heads, slots = 3;
  float* pool = Alloc<float>(slots * per_slot * words);
  std::vector<float> old_keys(d, 100.0f / 8.0f), new_keys(d, 1.0f / 4.0f);
  float* keys = Alloc<float>(2 * d);
  cudaMemcpy(keys, old_keys.data(), d * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(keys + d, new_keys.data(), d * 4, cudaMemcpyHostToDevice);
  EpsSummaryWriter* writer = nullptr;
  ASSERT_EQ(eps_engine_summary_writer_create(&model_, 0, &writer), 0);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto slot = [&](int s) { return pool + int64_t{s} * per_slot * words; };
  const EpsRecordRun all[] = {
      {Addr(slot(0)), per_slot}, {Addr(slot(2)), per_slot}, {Addr(slot(1)), per_slot}};
  ASSERT_EQ(eps_engine_summary_reset(writer, all, 3, Addr(stream)), 0) << eps_engine_last_error();
  const EpsKeyAppend old_group{Addr(slot(1)), Addr(keys), 1, 0, 1, 0};
  ASSERT_EQ(eps_engine_summary_append(writer, &old_group, 1, EPS_ENGINE_FLOAT32, Addr(stream)), 0);
  const EpsRecordRun reused{Addr(slot(1)), per_slot};
  ASSERT_EQ(eps_engine_summary_reset(writer, &reused, 1, Addr(stream)), 0);
  const EpsKeyAppend new_group{Addr(slot(1)), Addr(keys + d), 1, 0, 1, 0};
  const EpsKeyAppend fresh{Addr(slot(2)), Addr(keys + d), 1, 0, 1, 0};
  const EpsKeyAppend both[] = {new_group, fresh};
  ASSERT_EQ(eps_engine_summary_append(writer, both, 2, EPS_ENGINE_FLOAT32, Addr(stream)), 0);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<float> got(slots * per_slot * words);
  cudaMemcpy(got.data(), pool, got.size() * 4, cudaMemcpyDeviceToHost);
  std::vector<float> empty(words);
  ASSERT_TRUE(eps::ResetRecord(eps::SummaryLayout::For(layout), empty).ok());
  for (int r = 0; r < per_slot; ++r) {  // slot 0: reset only, core's bytes
    ASSERT_EQ(std::memcmp(&got[r * words], empty.data(), words * 4), 0) << "record " << r;
  }
  for (int r = 0; r < per_slot; ++r) {  // slot 1 (reused) equals slot 2 (fresh), bit for bit
    ASSERT_EQ(
        std::memcmp(&got[(per_slot + r) * words], &got[(2 * per_slot + r) * words], words * 4), 0)
        << "record " << r;
  }
  ExpectRefused(eps_engine_summary_reset(writer, nullptr, 2, 0), "runs is null, n=2");
  const EpsRecordRun overlapping[] = {{Addr(slot(0)), per_slot}, {Addr(slot(0) + words), 1}};
  ExpectRefused(eps_engine_summary_reset(writer, overlapping, 2, 0), "overlaps");
  const EpsRecordRun misaligned{Addr(slot(0)) + 4, 1};
  ExpectRefused(eps_engine_summary_reset(writer, &misaligned, 1, 0), "16-byte aligned");
  eps_engine_summary_writer_destroy(writer);
  cudaStreamDestroy(stream);
}

TEST_F(EngineCapiTest, ReleaseDenseOnAStreamIsOrderedWithThatStreamAndNotWaitedFor) {
  const int64_t n = 9;
  int32_t* counts = Alloc<int32_t>(n);
  uint64_t* flags = Alloc<uint64_t>(2);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // the engine's wait for step 6 comes after the release on the same stream: no hang
  ASSERT_EQ(eps_engine_release_dense(0, Addr(counts), n, Addr(flags), 6, Addr(stream)), 0)
      << eps_engine_last_error();
  ASSERT_EQ(eps_engine_wait_selection(Addr(stream), Addr(flags), 6), 0);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ExpectReleasedDensely(counts, n, flags, 6);
  // a release never lowers the counter
  ASSERT_EQ(eps_engine_release_dense(0, Addr(counts), n, Addr(flags), 2, 0), 0);
  EXPECT_EQ(SelectionDone(flags), 6u);
  cudaStreamDestroy(stream);
}

TEST_F(EngineCapiTest, WatchdogReleasesAStepThatNeverCompletesAndSparesACompletedOne) {
  const int64_t n = 12;
  int32_t* counts = Alloc<int32_t>(n);
  uint64_t* flags = Alloc<uint64_t>(2);
  ASSERT_EQ(cudaMemset(counts, 0x11, n * 4), cudaSuccess);
  EpsEngineWatchdog* dog = nullptr;
  ASSERT_EQ(eps_engine_watchdog_create(0, Addr(counts), n, Addr(flags), 20000, &dog), 0)
      << eps_engine_last_error();
  // completed: selection_done already 4 when step 4's timeout comes
  const uint64_t four = 4;
  cudaMemcpy(flags + 1, &four, 8, cudaMemcpyHostToDevice);
  ASSERT_EQ(eps_engine_watchdog_arm(dog, 4), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(eps_engine_watchdog_releases(dog), 0u);
  // never completed: step 5 is released densely after the 20 ms timeout
  ASSERT_EQ(eps_engine_watchdog_arm(dog, 5), 0);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (eps_engine_watchdog_releases(dog) == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(eps_engine_watchdog_releases(dog), 1u);
  ExpectReleasedDensely(counts, n, flags, 5);
  eps_engine_watchdog_destroy(dog);
}

// A step that falls back clears the selection feedback before its attention writes it
// (no selection consumed the step before's entries): on the engine's stream, on a private
// one, and by the watchdog before its release.
TEST_F(EngineCapiTest, FeedbackIsClearedOnEveryFailOpenPath) {
  const int64_t n = 5, entries = 1000;
  int32_t* counts = Alloc<int32_t>(n);
  uint64_t* flags = Alloc<uint64_t>(2);
  float* feedback = Alloc<float>(entries);
  const std::vector<float> stale(entries, 1.5f);
  const auto all_nan = [&] {
    std::vector<float> host(entries);
    EXPECT_EQ(cudaMemcpy(host.data(), feedback, entries * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return std::all_of(host.begin(), host.end(), [](float v) { return std::isnan(v); });
  };
  const auto make_stale = [&] {
    ASSERT_EQ(cudaMemcpy(feedback, stale.data(), entries * 4, cudaMemcpyHostToDevice), cudaSuccess);
  };
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  make_stale();
  ASSERT_EQ(eps_engine_clear_feedback(0, Addr(feedback), entries, Addr(stream)), 0)
      << eps_engine_last_error();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_TRUE(all_nan()) << "on the engine's stream";
  make_stale();
  ASSERT_EQ(eps_engine_clear_feedback(0, Addr(feedback), entries, 0), 0);
  EXPECT_TRUE(all_nan()) << "on a private stream, waited for";
  ExpectRefused(eps_engine_clear_feedback(0, 0, entries, 0), "feedback is null, n=1000");
  ExpectRefused(eps_engine_clear_feedback(0, Addr(feedback), -1, 0), "n=-1 is negative");

  make_stale();
  EpsEngineWatchdog* dog = nullptr;
  ASSERT_EQ(eps_engine_watchdog_create(0, Addr(counts), n, Addr(flags), 20000, &dog), 0)
      << eps_engine_last_error();
  ASSERT_EQ(eps_engine_watchdog_clear_feedback(dog, Addr(feedback), entries), 0);
  ASSERT_EQ(eps_engine_watchdog_arm(dog, 2), 0);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (eps_engine_watchdog_releases(dog) == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(eps_engine_watchdog_releases(dog), 1u);
  ExpectReleasedDensely(counts, n, flags, 2);
  EXPECT_TRUE(all_nan()) << "by the watchdog";
  ExpectRefused(eps_engine_watchdog_clear_feedback(dog, 0, 3), "feedback non-null");
  ExpectRefused(eps_engine_watchdog_clear_feedback(nullptr, 0, 0), "the watchdog is null");
  eps_engine_watchdog_destroy(dog);
  cudaStreamDestroy(stream);
}

// An engine shutting down while epsd is gone destroys its watchdog with a step armed:
// the destroy once dropped it, leaving the engine's stream waiting on selection_done for
// good (and its buffers' cudaDeviceSynchronize with it). Now the destroy finishes the
// watch: it releases the step at its due time.
TEST_F(EngineCapiTest, DestroyingAWatchdogWithAStepArmedReleasesItAtItsDueTime) {
  const int64_t n = 6;
  int32_t* counts = Alloc<int32_t>(n);
  uint64_t* flags = Alloc<uint64_t>(2);
  ASSERT_EQ(cudaMemset(counts, 0x11, n * 4), cudaSuccess);
  cudaStream_t engine;
  ASSERT_EQ(cudaStreamCreateWithFlags(&engine, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(eps_engine_wait_selection(Addr(engine), Addr(flags), 3), 0);  // epsd never writes
  EpsEngineWatchdog* dog = nullptr;
  ASSERT_EQ(eps_engine_watchdog_create(0, Addr(counts), n, Addr(flags), 50000, &dog), 0)
      << eps_engine_last_error();
  ASSERT_EQ(eps_engine_watchdog_arm(dog, 3), 0);
  const auto start = std::chrono::steady_clock::now();
  eps_engine_watchdog_destroy(dog);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ASSERT_EQ(cudaStreamSynchronize(engine), cudaSuccess);  // released: no hang
  ExpectReleasedDensely(counts, n, flags, 3);
  cudaStreamDestroy(engine);
}

// The destroy waits up to the armed step's due time; it once cleared the watchdog's pointer
// first, so an arm or a read from another thread meanwhile dereferenced null (a crash of the
// engine). A call overlapping the destroy is refused and touches nothing.
TEST_F(EngineCapiTest, WatchdogCallsOverlappingItsDestroyAreRefused) {
  const int64_t n = 6;
  int32_t* counts = Alloc<int32_t>(n);
  uint64_t* flags = Alloc<uint64_t>(2);
  ASSERT_EQ(cudaMemset(counts, 0x11, n * 4), cudaSuccess);
  EpsEngineWatchdog* dog = nullptr;
  ASSERT_EQ(eps_engine_watchdog_create(0, Addr(counts), n, Addr(flags), 1000000, &dog), 0)
      << eps_engine_last_error();
  ASSERT_EQ(eps_engine_watchdog_arm(dog, 3), 0);  // epsd never writes step 3
  std::thread destroyer([dog] { eps_engine_watchdog_destroy(dog); });
  // Until the destroy has begun the call succeeds (n = 0: no feedback); then it is refused.
  int rc = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (rc == 0 && std::chrono::steady_clock::now() < until) {
    rc = eps_engine_watchdog_clear_feedback(dog, 0, 0);
  }
  EXPECT_EQ(rc, 9) << eps_engine_last_error();  // FAILED_PRECONDITION
  EXPECT_EQ(eps_engine_watchdog_arm(dog, 4), 9);
  EXPECT_NE(std::string(eps_engine_last_error()).find("the watchdog is being destroyed"),
            std::string::npos)
      << eps_engine_last_error();
  EXPECT_EQ(eps_engine_watchdog_releases(dog), 0u);
  destroyer.join();  // no call after this: the handle is freed
  // The refused arm of 4 armed nothing.
  ExpectReleasedDensely(counts, n, flags, 3);
}

TEST(EngineCapiArgs, BadArgumentsAreReportedWithTheirValues) {
  EpsEngineWatchdog* dog = nullptr;
  EXPECT_EQ(eps_engine_watchdog_create(0, 0, 0, 0, 0, &dog), 3);  // INVALID_ARGUMENT
  EXPECT_NE(std::string(eps_engine_last_error()).find("timeout_us=0"), std::string::npos)
      << eps_engine_last_error();
  // A timeout past an hour bounds nothing (past 292 years its due time wrapped into the
  // past and every armed step was released at once).
  EXPECT_EQ(eps_engine_watchdog_create(0, 8, 1, 8, INT64_MAX, &dog), 3);
  EXPECT_NE(std::string(eps_engine_last_error()).find("must be in [1, 3600000000]"),
            std::string::npos)
      << eps_engine_last_error();
  // A grid of layers x batch x lists past 2^31 - 1 blocks (a cast to unsigned once
  // launched 2^32 fewer and returned OK). Stand-in addresses: nothing reaches them.
  constexpr uint64_t kSome = 256;
  EXPECT_EQ(eps_engine_flash_attention_views(kSome, kSome, 1 << 16, 2, 1 << 16, 8, kSome, 8, kSome,
                                             2, 16, 8, kSome, kSome, kSome, 0),
            3);
  EXPECT_NE(std::string(eps_engine_last_error()).find("the kernels' grid"), std::string::npos)
      << eps_engine_last_error();
  EXPECT_EQ(eps_engine_flashinfer_fixed(kSome, kSome, 1 << 16, 2, 1 << 16, 8, kSome, 8, kSome, 2,
                                        16, 8, kSome, 0, kSome, kSome, kSome, 0),
            3);
  EXPECT_NE(std::string(eps_engine_last_error()).find("the kernels' grid"), std::string::npos)
      << eps_engine_last_error();
  EpsEngineModel bad{0, 4, 2, 64, 16, 8, 8, 1, 1, 0, 0, 0};
  EpsSummaryWriter* writer = nullptr;
  EXPECT_EQ(eps_engine_summary_writer_create(&bad, 0, &writer), 3);
  EXPECT_NE(std::string(eps_engine_last_error()).find("num_layers"), std::string::npos)
      << eps_engine_last_error();
  EXPECT_EQ(eps_engine_abi_version(), EPS_ENGINE_ABI_VERSION);
}

// Every entry point refuses a null handle, a null required pointer or array, and a
// negative count with INVALID_ARGUMENT and a message, before touching the device: these
// once crashed the process (a null handle dereferenced; appends[0..n) read from null) or
// faulted the CUDA context for good (release_dense with flags 0 made a device atomic at
// address 8). No device needed: nothing reaches one.

TEST(EngineCapiArgs, NullHandlesAndPointersAreInvalidArgument) {
  ExpectRefused(eps_engine_device_count(nullptr), "count is null");
  ExpectRefused(eps_engine_signal_inputs_ready(0, 0, 1), "flags is null");
  ExpectRefused(eps_engine_wait_selection(0, 0, 1), "flags is null");
  ExpectRefused(eps_engine_wait_counter(0, 0, 1), "counter is null");
  ExpectRefused(eps_engine_release_dense(0, 0x1000, 4, 0, 1, 0), "flags is null");
  ExpectRefused(eps_engine_release_dense(0, 0, 4, 0x1000, 1, 0), "visit_count is null, n=4");
  ExpectRefused(eps_engine_release_dense(0, 0x1000, -1, 0x1000, 1, 0), "n=-1 is negative");
  ExpectRefused(eps_engine_watchdog_create(0, 0x1000, 4, 0x1000, 100, nullptr), "out is null");
  ExpectRefused(eps_engine_watchdog_arm(nullptr, 1), "the watchdog is null");
  // Step 0, the watchdog's "nothing armed", once dropped the armed step's watch (and
  // returned 0); it is checked before the handle.
  ExpectRefused(eps_engine_watchdog_arm(nullptr, 0), "step=0: steps start at 1");
  EXPECT_EQ(eps_engine_watchdog_releases(nullptr), 0u);
  EXPECT_NE(std::string(eps_engine_last_error()).find("the watchdog is null"), std::string::npos);
  eps_engine_watchdog_destroy(nullptr);  // a no-op, as free(NULL)

  EpsSummaryWriter* writer = nullptr;
  ExpectRefused(eps_engine_summary_writer_create(nullptr, 0, &writer), "model is null");
  const EpsEngineModel model{2, 4, 2, 64, 16, 8, 8, 1, 1, 0, 0, 0};
  ExpectRefused(eps_engine_summary_writer_create(&model, 0, nullptr), "out is null");
  int32_t words = 0;
  ExpectRefused(eps_engine_summary_writer_record_words(nullptr, &words), "the writer is null");
  EpsKeyAppend one{};
  ExpectRefused(eps_engine_summary_append(nullptr, &one, 1, EPS_ENGINE_FLOAT32, 0),
                "the writer is null");
  const EpsRecordRun run{};
  ExpectRefused(eps_engine_summary_reset(nullptr, &run, 1, 0), "the writer is null");
  eps_engine_summary_writer_destroy(nullptr);

  EpsSummaryQueue* queue = nullptr;
  ExpectRefused(eps_engine_summary_queue_create(nullptr, 0, &queue), "the writer is null");
  ExpectRefused(eps_engine_summary_queue_submit(nullptr, &one, 1, EPS_ENGINE_FLOAT32, 0, 1),
                "the queue is null");
  ExpectRefused(eps_engine_summary_queue_wait(nullptr, 0, 1), "the queue is null");
  ExpectRefused(eps_engine_summary_queue_drain(nullptr), "the queue is null");
  char buf[128] = "untouched";
  EXPECT_EQ(eps_engine_summary_queue_errors(nullptr, buf, sizeof buf), 0u);
  EXPECT_NE(std::string(buf).find("the queue is null"), std::string::npos) << buf;
  eps_engine_summary_queue_destroy(nullptr);
}

// A device pointer misaligned for the words the call's kernels or stream ops access there is
// refused before anything is queued: the raise kernel's 64-bit atomic on flags + 1, or a
// visit_count store, at a misaligned address faults and ends the CUDA context. No device
// needed: nothing reaches one.
TEST(EngineCapiArgs, MisalignedPointersAreInvalidArgument) {
  ExpectRefused(eps_engine_signal_inputs_ready(0, 0x1004, 1), "flags=0x1004 is not 8-byte aligned");
  ExpectRefused(eps_engine_wait_selection(0, 0x1004, 1), "flags=0x1004 is not 8-byte aligned");
  ExpectRefused(eps_engine_wait_counter(0, 0x1001, 1), "counter=0x1001 is not 8-byte aligned");
  ExpectRefused(eps_engine_release_dense(0, 0x1000, 4, 0x1004, 1, 0),
                "flags=0x1004 is not 8-byte aligned");
  ExpectRefused(eps_engine_release_dense(0, 0x1002, 4, 0x1000, 1, 0),
                "visit_count=0x1002 is not 4-byte aligned");
  EpsEngineWatchdog* dog = nullptr;
  ExpectRefused(eps_engine_watchdog_create(0, 0x1000, 4, 0x1004, 100, &dog),
                "flags=0x1004 is not 8-byte aligned");
  ExpectRefused(eps_engine_watchdog_create(0, 0x1001, 4, 0x1000, 100, &dog),
                "visit_count=0x1001 is not 4-byte aligned");
  EXPECT_EQ(dog, nullptr);
  // The float32 feedback a fail-open release NaN-fills (it was not checked).
  ExpectRefused(eps_engine_clear_feedback(0, 0x1002, 4, 0),
                "feedback=0x1002 is not 4-byte aligned");
  ExpectRefused(eps_engine_watchdog_clear_feedback(nullptr, 0x1001, 4),
                "feedback=0x1001 is not 4-byte aligned");
}

// The engine outputs' int32 arrays, inputs and outputs alike: each one misaligned in turn,
// the others at a stand-in aligned address that nothing reaches.
TEST(EngineCapiArgs, MisalignedOutputArraysAreInvalidArgument) {
  constexpr uint64_t kSome = 256;
  const char* const views[] = {"visit_blocks",    "visit_count", "engine_table", "context_tokens",
                               "block_table_out", "seqused_out", "refused_out"};
  for (int i = 0; i < 7; ++i) {
    uint64_t p[7] = {kSome, kSome, kSome, kSome, kSome, kSome, kSome};
    p[i] = kSome + 2;
    ExpectRefused(eps_engine_flash_attention_views(p[0], p[1], 1, 1, 1, 8, p[2], 8, p[3], 1, 16, 0,
                                                   p[4], p[5], p[6], 0),
                  std::string(views[i]) + "=0x102 is not 4-byte aligned");
  }
  const char* const fixed[] = {"visit_blocks", "visit_count", "engine_table",      "context_tokens",
                               "indptr",       "indices_out", "last_page_len_out", "mismatched"};
  for (int i = 0; i < 8; ++i) {
    uint64_t p[8] = {kSome, kSome, kSome, kSome, kSome, kSome, kSome, kSome};
    p[i] = kSome + 1;
    ExpectRefused(eps_engine_flashinfer_fixed(p[0], p[1], 1, 1, 1, 8, p[2], 8, p[3], 1, 16, 0, p[4],
                                              8, p[5], p[6], p[7], 0),
                  std::string(fixed[i]) + "=0x101 is not 4-byte aligned");
  }
}

TEST_F(EngineCapiTest, AppendsAreCheckedBeforeTheyAreRead) {
  EpsSummaryWriter* writer = nullptr;
  ASSERT_EQ(eps_engine_summary_writer_create(&model_, 0, &writer), 0) << eps_engine_last_error();
  int32_t words = 0;
  EXPECT_EQ(eps_engine_summary_writer_record_words(writer, nullptr), 3);
  ExpectRefused(eps_engine_summary_append(writer, nullptr, 2, EPS_ENGINE_FLOAT32, 0),
                "appends is null, n=2");
  EpsKeyAppend one{};
  ExpectRefused(eps_engine_summary_append(writer, &one, -1, EPS_ENGINE_FLOAT32, 0),
                "n=-1 is negative");
  EpsSummaryQueue* queue = nullptr;
  ASSERT_EQ(eps_engine_summary_queue_create(writer, 0, &queue), 0) << eps_engine_last_error();
  ExpectRefused(eps_engine_summary_queue_submit(queue, nullptr, 3, EPS_ENGINE_FLOAT32, 0, 1),
                "appends is null, n=3");
  ExpectRefused(eps_engine_summary_queue_submit(queue, &one, -2, EPS_ENGINE_FLOAT32, 0, 1),
                "n=-2 is negative");
  EXPECT_EQ(eps_engine_summary_writer_record_words(writer, &words), 0);
  eps_engine_summary_queue_destroy(queue);
  eps_engine_summary_writer_destroy(writer);
}

TEST_F(EngineCapiTest, AQueueKeepsItsWriterAliveWhenTheWriterIsDestroyedFirst) {
  // The queue borrowed the writer by reference: destroying the writer first left the queue
  // appending through freed memory.
  const int words = RecordWords(), d = model_.head_dim;
  float* pool = Alloc<float>(words + d);
  ASSERT_EQ(cudaMemset(pool, 0, sizeof(float) * (words + d)), cudaSuccess);
  EpsSummaryWriter* writer = nullptr;
  ASSERT_EQ(eps_engine_summary_writer_create(&model_, 0, &writer), 0) << eps_engine_last_error();
  EpsSummaryQueue* queue = nullptr;
  ASSERT_EQ(eps_engine_summary_queue_create(writer, 0, &queue), 0) << eps_engine_last_error();
  eps_engine_summary_writer_destroy(writer);
  const EpsKeyAppend append{Addr(pool), Addr(pool + words), 1, 0, 0, 0};
  ASSERT_EQ(eps_engine_summary_queue_submit(queue, &append, 1, EPS_ENGINE_FLOAT32, 0, 1), 0)
      << eps_engine_last_error();
  ASSERT_EQ(eps_engine_summary_queue_drain(queue), 0) << eps_engine_last_error();
  char buf[256] = {};
  EXPECT_EQ(eps_engine_summary_queue_errors(queue, buf, sizeof buf), 0u) << buf;
  eps_engine_summary_queue_destroy(queue);
}

}  // namespace
