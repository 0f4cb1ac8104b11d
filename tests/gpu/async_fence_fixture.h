// The engine side of tests/gpu/async_fence_test.cc and async_fence_counter_test.cc
// (one binary, async_fence_test): an engine process's buffers allocated through the
// client library (client::DeviceBuffers, one cudaMalloc exported over CUDA IPC), its
// stream's inputs_ready / selection_done counters, and core/'s lists to compare with.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <future>
#include <random>
#include <thread>
#include <vector>

#include "client/cpp/device_buffers.h"
#include "client/cpp/eps_client.h"
#include "client/cpp/selection_watchdog.h"
#include "core/buffer_contract.h"
#include "core/layout.h"
#include "core/phi.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gpu/ipc_mapping.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"
#include "tests/gpu/host_copy.h"
#include "tests/service/epsd_process.h"

namespace eps::async_fence {

// The records these tests write carry no quest part, so both sides score with jl.
inline SelectPolicy JlPolicy() {
  SelectPolicy p;
  p.method = Method::kJl;
  return p;
}

constexpr int kLayers = 4, kQHeads = 8, kKvHeads = 2, kDim = 128, kBatch = 2;
constexpr int64_t kTokens = 6000;

// Delays the engine's stream on the host (a stand-in for a slow forward pass),
// so that a sidecar reading the queries without waiting would read stale ones.
inline void CUDART_CB HoldStream(void* us) {
  std::this_thread::sleep_for(std::chrono::microseconds(reinterpret_cast<intptr_t>(us)));
}

class AsyncFenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
    seed_ = testing::TestSeed();
    rng_.seed(seed_);
    m_.num_layers = kLayers;
    m_.num_q_heads = kQHeads;
    m_.num_kv_heads = kKvHeads;
    m_.head_dim = kDim;
    m_.phi_seed = 91;
    m_.group_blocks = 8;
    m_.features = {.key_sum = true, .principal = false, .quest = false};
    phi_ = std::make_unique<PhiBank>(*PhiBank::Create(m_.phi_seed, kLayers, kKvHeads, kDim, 8));
    reference_ = std::make_unique<PageSelector>(*PageSelector::Create(m_, *phi_));
    host_ =
        std::make_unique<testing::StepBuffers>(m_, kBatch, kTokens, kBatch, Granularity::kUnion);
    SummaryWriter writer(m_, *phi_);
    for (int r = 0; r < kBatch; ++r) {
      testing::WriteSequence(*host_, writer, r, r, kTokens - 7 * r, 2,
                             testing::GroupShapes::kSynthetic, rng_);
      rows_.push_back({.table_row = r, .context_tokens = kTokens - 7 * r, .seq_id = 0});
    }
    client::BufferShape shape{.num_slots = host_->num_slots(),
                              .max_seqs = kBatch,
                              .max_context = kTokens,
                              .max_batch = kBatch};
    auto buffers = client::DeviceBuffers::Create(m_, shape, 0);
    ASSERT_TRUE(buffers.ok()) << buffers.status();
    buffers_ = std::move(*buffers);
    ASSERT_EQ(buffers_->plan().max_groups, host_->max_groups());
    ASSERT_EQ(buffers_->plan().max_blocks, host_->max_blocks());
    Upload(buffers_->summary_pool(), host_->pool());
    Upload(buffers_->group_table(), host_->group_table());
    Upload(buffers_->block_table(), host_->block_table());
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }

  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  template <typename T, typename V>
  void Upload(T* device, const V& host) {
    ASSERT_EQ(::eps::testing::CopyToDeviceNow(device, host.data(), host.size() * sizeof(host[0])),
              cudaSuccess);
  }

  v1::AttachRequest Attach() const {
    v1::AttachRequest attach;
    attach.set_engine_id("async-fence-engine");
    v1::ModelLayout* l = attach.mutable_layout();
    l->set_num_layers(kLayers);
    l->set_num_q_heads(kQHeads);
    l->set_num_kv_heads(kKvHeads);
    l->set_head_dim(kDim);
    l->set_summary_layout(eps::kSummaryLayoutRevision);  // core/layout.h
    l->set_block_size(16);
    l->set_group_blocks(m_.group_blocks);
    l->set_sketch_dim(8);
    l->set_phi_seed(m_.phi_seed);
    l->mutable_features()->set_key_sum(true);
    attach.mutable_options()->set_method(v1::METHOD_JL);  // records without a quest part
    buffers_->DescribeTo(&attach);                        // buffers, device and device_uuid
    attach.set_max_batch(kBatch);
    attach.set_num_kv_blocks(kBatch * host_->max_blocks());
    attach.set_backend(v1::BACKEND_CUDA);
    return attach;
  }

  // Async replies to `epsd`, with a deadline no GPU step here comes near.
  static client::ClientOptions AsyncOptions(testing::EpsdProcess& epsd) {
    client::ClientOptions options;
    options.target = epsd.target();
    options.deadline = std::chrono::seconds(2);
    options.reply_async = true;
    return options;
  }

  // Sync replies, and errors returned instead of falling back.
  static client::ClientOptions SyncFailClosedOptions(testing::EpsdProcess& epsd) {
    client::ClientOptions options = AsyncOptions(epsd);
    options.reply_async = false;
    options.fail_open = false;
    return options;
  }

  std::vector<v1::BatchRow> Rows() const {
    std::vector<v1::BatchRow> rows;
    for (const StepRow& r : rows_) {
      v1::BatchRow row;
      row.set_table_row(r.table_row);
      row.set_context_tokens(r.context_tokens);
      rows.push_back(row);
    }
    return rows;
  }

  // Fresh random queries on the host, copied on the engine's stream after
  // `hold_us` of host delay, then inputs_ready = step.
  void WriteQueries(uint64_t step, int hold_us) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const size_t count = size_t{kLayers} * kBatch * kQHeads * kDim;
    float* q = &host_->Query(0, 0, 0)[0];
    for (size_t i = 0; i < count; ++i) q[i] = normal(rng_);
    staged_.assign(q, q + count);
    if (hold_us > 0) {
      ASSERT_EQ(cudaLaunchHostFunc(stream_, HoldStream, reinterpret_cast<void*>(intptr_t{hold_us})),
                cudaSuccess);
    }
    ASSERT_EQ(cudaMemcpyAsync(buffers_->queries(), staged_.data(), count * 4,
                              cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    ASSERT_TRUE(buffers_->SignalInputsReady(stream_, step).ok());
  }

  // Waits (bounded) for the engine's stream; false if it is still blocked.
  bool StreamDrains(std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (cudaStreamQuery(stream_) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::yield();
    }
    return cudaStreamQuery(stream_) == cudaSuccess;
  }

  std::vector<int32_t> Counts() {
    std::vector<int32_t> count(kLayers * kBatch);
    EXPECT_EQ(
        cudaMemcpy(count.data(), buffers_->visit_count(), count.size() * 4, cudaMemcpyDeviceToHost),
        cudaSuccess);
    return count;
  }

  // Lists in device memory against the core/ reference on the same inputs;
  // returns the number of lists that differ (by at most 2 groups: fp32 ties).
  // Step 1 is accepted while inputs_ready holds its wait; step 2 finds it still
  // waiting, has epsd release it (after --inputs-timeout-ms) and report it, then is
  // selected from its own queries (written only after the call: inputs_ready = 2
  // would also satisfy step 1's wait, which is GEQ).
  void ExpectHeldStepReleasedAndTheNextSelected(client::EpsClient& client,
                                                testing::EpsdProcess& epsd) {
    const client::StepResult first = client.SelectPages(1, Rows());
    ASSERT_FALSE(first.fallback) << first.status;
    const client::StepResult second = client.SelectPages(2, Rows());
    ASSERT_FALSE(second.fallback) << second.status << "\n" << epsd.Log();
    ASSERT_EQ(second.response.earlier_size(), 1);
    EXPECT_EQ(second.response.earlier(0).step(), 1u);
    EXPECT_NE(second.response.earlier(0).error().find("inputs_ready"), std::string::npos)
        << second.response.earlier(0).error();
    WriteQueries(2, 0);
    ASSERT_TRUE(buffers_->WaitSelection(stream_, 2).ok());
    ASSERT_TRUE(StreamDrains(std::chrono::seconds(5)));
    EXPECT_LE(CompareWithReference(), 1);
  }

  int CompareWithReference(const SelectPolicy& policy = JlPolicy()) {
    StepStats stats;
    EXPECT_TRUE(reference_->Select(host_->Inputs(rows_), policy, host_->Outputs(), &stats).ok());
    std::vector<int32_t> visit(size_t{kLayers} * kBatch * host_->max_blocks());
    EXPECT_EQ(cudaMemcpy(visit.data(), buffers_->visit_blocks(), visit.size() * 4,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    const std::vector<int32_t> count = Counts();
    int differing_lists = 0;
    for (int layer = 0; layer < kLayers; ++layer) {
      for (int r = 0; r < kBatch; ++r) {
        const auto want = host_->VisitBlocks(layer, r);
        const int64_t index = int64_t{layer} * kBatch + r;
        EXPECT_GE(count[index], 0);
        if (count[index] < 0) return kLayers * kBatch;
        const std::vector<int32_t> got(visit.begin() + index * host_->max_blocks(),
                                       visit.begin() + index * host_->max_blocks() + count[index]);
        if (std::vector<int32_t>(want.begin(), want.end()) == got) continue;
        const int64_t n = GroupsFor(rows_[r].context_tokens, m_);
        const auto a = testing::VisitedGroups(*host_, r, want, n);
        const auto c = testing::VisitedGroups(*host_, r, got, n);
        int differing = 0;
        for (int64_t p = 0; p < n; ++p) differing += a[p] != c[p];
        EXPECT_LE(differing, 2) << "layer " << layer << " row " << r;
        ++differing_lists;
      }
    }
    return differing_lists;
  }

  // The device buffers as the GPU selector reads them (the tests that drive a
  // GpuSelector directly, without epsd).
  StepInputs DeviceInputs() const {
    StepInputs in = host_->Inputs(rows_);
    in.summary_pool = buffers_->summary_pool();
    in.group_table = buffers_->group_table();
    in.block_table = buffers_->block_table();
    in.queries = buffers_->queries();
    return in;
  }
  StepOutputs DeviceOutputs() const { return {buffers_->visit_blocks(), buffers_->visit_count()}; }
  // group_table[0][group] = slot on the device (a bad slot, or the good one back).
  void SetGroupSlot(int group, int32_t slot) {
    ASSERT_EQ(::eps::testing::CopyToDeviceNow(buffers_->group_table() + group, &slot, 4),
              cudaSuccess);
  }
  // A synchronous copy: the selector's streams are non-blocking, so it never waits on them.
  static void SetCounter(uint64_t* at, uint64_t value) {
    ASSERT_EQ(::eps::testing::CopyToDeviceNow(at, &value, sizeof value), cudaSuccess);
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  ModelLayout m_;
  std::unique_ptr<PhiBank> phi_;
  std::unique_ptr<PageSelector> reference_;
  std::unique_ptr<testing::StepBuffers> host_;
  std::vector<StepRow> rows_;
  std::shared_ptr<client::DeviceBuffers> buffers_;  // shared with the tests' watchdogs
  cudaStream_t stream_ = nullptr;
  std::vector<float> staged_;
};

}  // namespace eps::async_fence
