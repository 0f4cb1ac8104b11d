// Two processes on one GPU: this test is the engine (it allocates the buffers
// with cudaMalloc, exports one CUDA IPC handle, writes each decoded key's summary
// with the gpu/ writer as it decodes) and drives a real `epsd --backend=cuda`
// through the C++ client for 1000 steps; every step's visit lists, read back
// from device memory, are checked against the core/ reference run on a host
// copy of the same inputs.
#include <cuda_runtime.h>

#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "client/cpp/eps_client.h"
#include "core/layout.h"
#include "core/phi.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gpu/step.h"
#include "gpu/summary.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"
#include "tests/gpu/host_copy.h"
#include "tests/service/epsd_process.h"

namespace eps {
namespace {

// The records these tests write carry no quest part, so both sides score with jl.
SelectPolicy JlPolicy() {
  SelectPolicy p;
  p.method = Method::kJl;
  return p;
}

struct Region {  // one cudaMalloc holding every buffer, 256-byte aligned parts
  uint64_t pool, groups, blocks, queries, visit, count, flags, keys, size;
};

v1::MemoryDescriptor Describe(const std::string& handle, uint64_t offset,
                              std::initializer_list<int64_t> shape, v1::DType dtype) {
  v1::MemoryDescriptor d;
  d.mutable_cuda_ipc()->set_handle(handle);
  d.mutable_cuda_ipc()->set_device(0);
  d.set_offset(offset);
  for (int64_t dim : shape) d.add_shape(dim);
  d.set_dtype(dtype);
  return d;
}

TEST(TwoProcessGpuTest, EpsdCudaBackendMatchesTheCoreReferenceFor1000Steps) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  ModelLayout m;
  m.num_layers = 4;
  m.num_q_heads = 8;
  m.num_kv_heads = 2;
  m.head_dim = 128;
  m.phi_seed = 77;
  m.group_blocks = 8;
  m.features = {.key_sum = true, .principal = false, .quest = false};
  const int batch = 2, steps = 1000;
  const int64_t start_tokens = 6000, max_context = start_tokens + steps + 8;
  auto phi = PhiBank::Create(m.phi_seed, m.num_layers, m.num_kv_heads, m.head_dim, m.sketch_dim);
  auto reference = PageSelector::Create(m, *phi);
  SummaryWriter writer(m, *phi);
  testing::StepBuffers host(m, batch, max_context, batch, Granularity::kUnion);
  for (int r = 0; r < batch; ++r) {
    testing::WriteSequence(host, writer, r, r, start_tokens, 2, testing::GroupShapes::kSynthetic,
                           rng);
  }
  const SummaryLayout layout = SummaryLayout::For(m);
  const int64_t slots = host.num_slots();
  auto align = [](uint64_t x) { return (x + 255) / 256 * 256; };
  Region g{};
  uint64_t at = 0;
  auto take = [&](uint64_t bytes) {
    const uint64_t o = at;
    at = align(at + bytes);
    return o;
  };
  g.pool = take(host.pool().size() * 4);
  g.groups = take(host.group_table().size() * 4);
  g.blocks = take(host.block_table().size() * 4);
  const size_t query_count = size_t{4} * batch * 8 * 128;
  g.queries = take(query_count * 4);
  g.visit = take(size_t{4} * batch * host.max_blocks() * 4);
  g.count = take(size_t{4} * batch * 4);
  g.flags = take(16);
  g.keys = take(4 * 2 * 128 * 4);  // the step's new keys, [layers, kv_heads, d]
  g.size = at;
  std::byte* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, g.size), cudaSuccess);
  ASSERT_EQ(cudaMemset(device, 0, g.size), cudaSuccess);
  cudaIpcMemHandle_t handle;
  ASSERT_EQ(cudaIpcGetMemHandle(&handle, device), cudaSuccess);
  const std::string handle_bytes(reinterpret_cast<const char*>(&handle), sizeof(handle));
  auto upload = [&](uint64_t offset, const void* data, size_t bytes) {
    ASSERT_EQ(::eps::testing::CopyToDeviceNow(device + offset, data, bytes), cudaSuccess);
  };
  upload(g.pool, host.pool().data(), host.pool().size() * 4);
  upload(g.groups, host.group_table().data(), host.group_table().size() * 4);
  upload(g.blocks, host.block_table().data(), host.block_table().size() * 4);
  const float* host_queries = &host.Query(0, 0, 0)[0];
  auto device_writer = gpu::DeviceSummaryWriter::Create(m, 0);
  ASSERT_TRUE(device_writer.ok()) << device_writer.status();
  upload(g.queries, host_queries, query_count * 4);

  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket("cuda"), {"--backend=cuda"});
  ASSERT_NE(epsd, nullptr);
  v1::AttachRequest attach;
  attach.set_engine_id("two-process-engine");
  v1::ModelLayout* l = attach.mutable_layout();
  l->set_num_layers(4);
  l->set_num_q_heads(8);
  l->set_num_kv_heads(2);
  l->set_head_dim(128);
  l->set_summary_layout(eps::kSummaryLayoutRevision);  // core/layout.h
  l->set_block_size(16);
  l->set_group_blocks(m.group_blocks);
  l->set_sketch_dim(8);
  l->set_phi_seed(m.phi_seed);
  l->mutable_features()->set_key_sum(true);
  attach.mutable_options()->set_method(v1::METHOD_JL);  // records without a quest part
  v1::SharedBuffers* b = attach.mutable_buffers();
  *b->mutable_summary_pool() =
      Describe(handle_bytes, g.pool, {slots, 4, 2, layout.record_words}, v1::DTYPE_FLOAT32);
  *b->mutable_group_table() =
      Describe(handle_bytes, g.groups, {batch, host.max_groups()}, v1::DTYPE_INT32);
  *b->mutable_block_table() =
      Describe(handle_bytes, g.blocks, {batch, host.max_blocks()}, v1::DTYPE_INT32);
  *b->mutable_queries() = Describe(handle_bytes, g.queries, {4, batch, 8, 128}, v1::DTYPE_FLOAT32);
  *b->mutable_visit_blocks() =
      Describe(handle_bytes, g.visit, {4, batch, host.max_blocks()}, v1::DTYPE_INT32);
  *b->mutable_visit_count() = Describe(handle_bytes, g.count, {4, batch}, v1::DTYPE_INT32);
  *b->mutable_flags() = Describe(handle_bytes, g.flags, {2}, v1::DTYPE_UINT64);
  attach.set_max_batch(batch);
  attach.set_num_kv_blocks(batch * host.max_blocks());
  attach.set_backend(v1::BACKEND_CUDA);
  client::ClientOptions options;
  options.target = epsd->target();
  options.deadline = std::chrono::seconds(2);
  client::EpsClient client(options, attach);
  ASSERT_EQ(client.Attach(), absl::OkStatus()) << epsd->Log();

  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<int64_t> tokens(batch, start_tokens);
  int64_t lists = 0, differing_lists = 0, differing_groups = 0;
  double prepass_sum = 0;
  std::vector<double> round_trips;
  for (int step = 1; step <= steps; ++step) {
    std::vector<v1::BatchRow> rows;
    std::vector<StepRow> step_rows;
    for (int r = 0; r < batch; ++r) {
      // Decode one token: append its key to the summary of its group, on the
      // host and in device memory (the whole slot: all layers and KV heads).
      const int64_t t = tokens[r]++;
      const int64_t group = t / m.group_tokens();
      const int32_t slot = host.SlotOf(r, group);
      // The device copy is written by the gpu/ writer, as an engine's K-write
      // hook would; the host copy by core/'s, for the reference.
      const size_t slot_words = size_t{4} * 2 * layout.record_words;
      std::vector<float> new_keys(4 * 2 * 128);
      for (float& x : new_keys) x = normal(rng);
      if (t % m.group_tokens() == 0) {  // a new group: both copies start empty
        for (int layer = 0; layer < 4; ++layer) {
          for (int kvh = 0; kvh < 2; ++kvh)
            EXPECT_TRUE(writer.Reset(host.Record(slot, layer, kvh)).ok());
        }
        upload(g.pool + slot * slot_words * 4, host.Record(slot, 0, 0).data(), slot_words * 4);
      }
      upload(g.keys, new_keys.data(), new_keys.size() * 4);
      std::vector<gpu::KeyAppend> appends;
      for (int layer = 0; layer < 4; ++layer) {
        for (int kvh = 0; kvh < 2; ++kvh) {
          const float* key = new_keys.data() + (layer * 2 + kvh) * 128;
          ASSERT_TRUE(
              writer
                  .Append(host.Record(slot, layer, kvh), layer, kvh, {key, DType::kFloat32, 1, 128})
                  .ok());
          const uint64_t record_offset =
              g.pool + ((uint64_t(slot) * 4 + layer) * 2 + kvh) * layout.record_words * 4;
          appends.push_back({reinterpret_cast<float*>(device + record_offset),
                             device + g.keys + (layer * 2 + kvh) * 128 * 4, 1, 0, layer, kvh});
        }
      }
      ASSERT_TRUE((*device_writer)->Append(appends, DType::kFloat32).ok());
      v1::BatchRow row;
      row.set_table_row(r);
      row.set_context_tokens(tokens[r]);
      rows.push_back(row);
      step_rows.push_back({.table_row = r, .context_tokens = tokens[r], .seq_id = 0});
    }
    for (int layer = 0; layer < 4; ++layer) {  // queries drift a little each step
      for (int r = 0; r < batch; ++r) {
        for (int h = 0; h < 8; ++h) {
          for (float& x : host.Query(layer, r, h)) x += 0.05f * normal(rng);
        }
      }
    }
    upload(g.queries, host_queries, query_count * 4);

    const client::StepResult result = client.SelectPages(step, rows);
    ASSERT_FALSE(result.fallback) << "step " << step << ": " << result.status << "\n"
                                  << epsd->Log();
    prepass_sum += result.response.stats().prepass_us();
    round_trips.push_back(result.round_trip_us);
    uint64_t done = 0;
    ASSERT_EQ(cudaMemcpy(&done, device + g.flags + 8, 8, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(done, static_cast<uint64_t>(step)) << "selection_done";

    StepStats stats;
    ASSERT_TRUE(reference->Select(host.Inputs(step_rows), JlPolicy(), host.Outputs(), &stats).ok());
    std::vector<int32_t> visit(size_t{4} * batch * host.max_blocks()), count(4 * batch);
    ASSERT_EQ(cudaMemcpy(visit.data(), device + g.visit, visit.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(count.data(), device + g.count, count.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (int layer = 0; layer < 4; ++layer) {
      for (int r = 0; r < batch; ++r) {
        ++lists;
        const auto want = host.VisitBlocks(layer, r);
        const int64_t index = int64_t{layer} * batch + r;
        const std::vector<int32_t> got(visit.begin() + index * host.max_blocks(),
                                       visit.begin() + index * host.max_blocks() + count[index]);
        if (std::vector<int32_t>(want.begin(), want.end()) == got) continue;
        // Only fp32 ties at a threshold may differ: a group or two, rarely.
        const int64_t n = GroupsFor(tokens[r], m);
        const auto a = testing::VisitedGroups(host, r, want, n);
        const auto c = testing::VisitedGroups(host, r, got, n);
        int differing = 0;
        for (int64_t p = 0; p < n; ++p) differing += a[p] != c[p];
        ++differing_lists;
        differing_groups += differing;
        ASSERT_LE(differing, 2) << "step " << step << " layer " << layer << " row " << r;
      }
    }
  }
  std::printf(
      "two-process cuda: %d steps, %lld lists, %lld differ from the reference "
      "(%lld groups, fp32 ties), mean pre-pass %.1f us\n",
      steps, static_cast<long long>(lists), static_cast<long long>(differing_lists),
      static_cast<long long>(differing_groups), prepass_sum / steps);
  EXPECT_LE(differing_lists, lists / 100) << "more disagreement than fp32 ties explain";
  // The floor: an empty Ping on the same channel, measured in the same run.
  std::vector<double> pings;
  for (int i = 0; i < 1000; ++i) {
    const auto start = std::chrono::steady_clock::now();
    ASSERT_TRUE(client.Ping(std::chrono::seconds(1)).ok());
    pings.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
            .count());
  }
  std::printf(
      "round trip over UDS: SelectPages p50 %.1f us p99 %.1f us; Ping p50 %.1f us p99 %.1f us\n",
      testing::Percentile(round_trips, 0.5), testing::Percentile(round_trips, 0.99),
      testing::Percentile(pings, 0.5), testing::Percentile(pings, 0.99));
  ASSERT_TRUE(client.Detach().ok());
  cudaFree(device);
}

}  // namespace
}  // namespace eps
