// One tensor-parallel rank of a test engine, started by multi_rank_test: it
// holds its rank's share of the KV heads (kv_heads / ranks of a 32-query-head,
// 8-KV-head model), allocates its buffers on its GPU with cudaMalloc, attaches
// to epsd as its own session, and steps in lockstep with the other ranks (the
// RankBoard barrier) for --steps steps. Every step's visit lists, read back from
// device memory, are checked against the core/ reference run on a host copy of
// the same inputs; it prints one summary line and exits 0 when all matched.
//
// Flags (all required but --uuid): --target=unix:///... --board=/shm-name
// --rank=R --ranks=N --steps=S --seed=X --device=D (this process's ordinal of
// its GPU) --uuid=1 (name the device by UUID in Attach, as a rank started with
// CUDA_VISIBLE_DEVICES must: its ordinal D is not epsd's).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "client/cpp/eps_client.h"
#include "core/bounds.h"
#include "core/layout.h"
#include "core/phi.h"
#include "core/select.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gpu/device.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"
#include "tests/gpu/rank_board.h"

namespace eps {
namespace {

constexpr int kLayers = 4, kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kBatch = 2;

// How far group p of (layer, row) is from being visited under core's threshold
// rule for a union list: max over the layer's query heads of (score - cut) / |cut|,
// the cut being the head's top_pages-th largest unforced score over alpha
// (negative: not visited). Forced groups return +inf.
double CutMargin(const ModelLayout& m, const PhiBank& phi, testing::StepBuffers& host,
                 const SelectPolicy& policy, int layer, int row, int64_t n, int64_t p) {
  std::vector<uint8_t> forced(static_cast<size_t>(n), 0);
  MarkForced(policy, forced);
  if (forced[p]) return INFINITY;
  const SummaryLayout layout = SummaryLayout::For(m);
  double best = -INFINITY;
  for (int h = 0; h < m.num_q_heads; ++h) {
    const int kvh = h / m.gqa_ratio();
    QueryTerms terms;
    terms.Prepare(phi, layer, kvh, host.Query(layer, row, h));
    std::vector<float> scores;
    float mine = 0.0f;
    for (int64_t g = 0; g < n; ++g) {
      const float score =
          Score(policy.method, host.Record(host.SlotOf(row, g), layer, kvh), layout, terms);
      if (g == p) mine = score;
      if (!forced[g]) scores.push_back(score);
    }
    if (static_cast<int64_t>(scores.size()) <= policy.top_pages) return INFINITY;
    std::nth_element(scores.begin(), scores.begin() + (policy.top_pages - 1), scores.end(),
                     std::greater<float>());
    const float t = scores[policy.top_pages - 1];
    const float cut = t > 0.0f ? t / policy.alpha : t * policy.alpha;
    best = std::max(best, (static_cast<double>(mine) - cut) / std::max(std::abs(cut), 1e-30f));
  }
  return best;
}
constexpr int64_t kStartTokens = 6000;

struct Flags {
  std::string target, board;
  int rank = -1, ranks = 0, steps = 0, device = -1;
  uint64_t seed = 0;
  bool uuid = false;
};

bool ParseArgs(int argc, char** argv, Flags* f) {
  std::map<std::string, std::string> kv;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    if (a.rfind("--", 0) != 0 || eq == std::string::npos) return false;
    kv[a.substr(2, eq - 2)] = a.substr(eq + 1);
  }
  f->target = kv["target"];
  f->board = kv["board"];
  f->uuid = kv["uuid"] == "1";
  return !f->target.empty() && !f->board.empty() && absl::SimpleAtoi(kv["rank"], &f->rank) &&
         absl::SimpleAtoi(kv["ranks"], &f->ranks) && absl::SimpleAtoi(kv["steps"], &f->steps) &&
         absl::SimpleAtoi(kv["device"], &f->device) && absl::SimpleAtoi(kv["seed"], &f->seed) &&
         f->ranks > 0 && kKvHeads % f->ranks == 0 && f->rank >= 0 && f->rank < f->ranks &&
         f->steps > 0;
}

v1::MemoryDescriptor Describe(const std::string& handle, int device, uint64_t offset,
                              std::initializer_list<int64_t> shape, v1::DType dtype) {
  v1::MemoryDescriptor d;
  d.mutable_cuda_ipc()->set_handle(handle);
  d.mutable_cuda_ipc()->set_device(device);
  d.set_offset(offset);
  for (int64_t dim : shape) d.add_shape(dim);
  d.set_dtype(dtype);
  return d;
}

#define RANK_CHECK(cond, ...)                        \
  do {                                               \
    if (!(cond)) {                                   \
      std::fprintf(stderr, "rank %d: ", flags.rank); \
      std::fprintf(stderr, __VA_ARGS__);             \
      std::fprintf(stderr, "\n");                    \
      board->failed.store(1);                        \
      return 1;                                      \
    }                                                \
  } while (false)

#define CUDA_CHECK(expr) RANK_CHECK((expr) == cudaSuccess, "%s failed", #expr)

int Run(const Flags& flags, testing::RankBoard* board) {
  const int kv = kKvHeads / flags.ranks, q = kQHeads / flags.ranks;
  const uint64_t seed = flags.seed * 1000003 + flags.rank;  // each rank its own data
  std::mt19937_64 rng(seed);
  ModelLayout m;
  m.num_layers = kLayers;
  m.num_q_heads = q;
  m.num_kv_heads = kv;
  m.head_dim = kHeadDim;
  m.phi_seed = 77 + flags.rank;
  m.group_blocks = 8;
  m.features = {.key_sum = true, .principal = false, .quest = false};
  const int64_t max_context = kStartTokens + flags.steps + 8;
  auto phi = PhiBank::Create(m.phi_seed, m.num_layers, m.num_kv_heads, m.head_dim, m.sketch_dim);
  RANK_CHECK(phi.ok(), "PhiBank: %s", phi.status().ToString().c_str());
  auto reference = PageSelector::Create(m, *phi);
  RANK_CHECK(reference.ok(), "PageSelector: %s", reference.status().ToString().c_str());
  SummaryWriter writer(m, *phi);
  testing::StepBuffers host(m, kBatch, max_context, kBatch, Granularity::kUnion);
  for (int r = 0; r < kBatch; ++r) {
    testing::WriteSequence(host, writer, r, r, kStartTokens, 2, testing::GroupShapes::kSynthetic,
                           rng);
  }
  const SummaryLayout layout = SummaryLayout::For(m);
  auto align = [](uint64_t x) { return (x + 255) / 256 * 256; };
  uint64_t at = 0;
  auto take = [&](uint64_t bytes) {
    const uint64_t o = at;
    at = align(at + bytes);
    return o;
  };
  const size_t query_count = size_t{kLayers} * kBatch * q * kHeadDim;
  const uint64_t pool = take(host.pool().size() * 4), groups = take(host.group_table().size() * 4),
                 blocks = take(host.block_table().size() * 4), queries = take(query_count * 4),
                 visit = take(size_t{kLayers} * kBatch * host.max_blocks() * 4),
                 count = take(size_t{kLayers} * kBatch * 4), flags_at = take(16);
  CUDA_CHECK(cudaSetDevice(flags.device));
  std::byte* device = nullptr;
  CUDA_CHECK(cudaMalloc(&device, at));
  CUDA_CHECK(cudaMemset(device, 0, at));
  cudaIpcMemHandle_t handle;
  CUDA_CHECK(cudaIpcGetMemHandle(&handle, device));
  const std::string handle_bytes(reinterpret_cast<const char*>(&handle), sizeof(handle));
  auto upload = [&](uint64_t offset, const void* data, size_t bytes) {
    return cudaMemcpy(device + offset, data, bytes, cudaMemcpyHostToDevice) == cudaSuccess;
  };
  RANK_CHECK(upload(pool, host.pool().data(), host.pool().size() * 4) &&
                 upload(groups, host.group_table().data(), host.group_table().size() * 4) &&
                 upload(blocks, host.block_table().data(), host.block_table().size() * 4),
             "upload");
  const float* host_queries = &host.Query(0, 0, 0)[0];

  v1::AttachRequest attach;
  attach.set_engine_id("multi-rank-engine/rank" + std::to_string(flags.rank));
  v1::ModelLayout* l = attach.mutable_layout();
  l->set_num_layers(kLayers);
  l->set_num_q_heads(q);
  l->set_num_kv_heads(kv);
  l->set_head_dim(kHeadDim);
  l->set_summary_layout(eps::kSummaryLayoutRevision);  // core/layout.h
  l->set_block_size(16);
  l->set_group_blocks(m.group_blocks);
  l->set_sketch_dim(8);
  l->set_phi_seed(m.phi_seed);
  l->mutable_features()->set_key_sum(true);
  const int d = flags.device;
  const int64_t slots = host.num_slots();
  v1::SharedBuffers* b = attach.mutable_buffers();
  *b->mutable_summary_pool() =
      Describe(handle_bytes, d, pool, {slots, kLayers, kv, layout.record_words}, v1::DTYPE_FLOAT32);
  *b->mutable_group_table() =
      Describe(handle_bytes, d, groups, {kBatch, host.max_groups()}, v1::DTYPE_INT32);
  *b->mutable_block_table() =
      Describe(handle_bytes, d, blocks, {kBatch, host.max_blocks()}, v1::DTYPE_INT32);
  *b->mutable_queries() =
      Describe(handle_bytes, d, queries, {kLayers, kBatch, q, kHeadDim}, v1::DTYPE_FLOAT32);
  *b->mutable_visit_blocks() =
      Describe(handle_bytes, d, visit, {kLayers, kBatch, host.max_blocks()}, v1::DTYPE_INT32);
  *b->mutable_visit_count() = Describe(handle_bytes, d, count, {kLayers, kBatch}, v1::DTYPE_INT32);
  *b->mutable_flags() = Describe(handle_bytes, d, flags_at, {2}, v1::DTYPE_UINT64);
  attach.set_max_batch(kBatch);
  attach.set_num_kv_blocks(kBatch * host.max_blocks());
  attach.set_backend(v1::BACKEND_CUDA);
  // jl, named on both sides: the records carry no quest part, and the test is about ranks,
  // not about which method the server's flags default to.
  attach.mutable_options()->set_method(v1::METHOD_JL);
  attach.set_device(d);
  if (flags.uuid) {
    auto uuid = gpu::DeviceUuid(d);
    RANK_CHECK(uuid.ok(), "DeviceUuid: %s", uuid.status().ToString().c_str());
    attach.set_device_uuid(*uuid);
  }
  client::ClientOptions options;
  options.target = flags.target;
  options.deadline = std::chrono::seconds(5);
  // epsd may create this device's context at this attach: no 500 ms limit.
  options.attach_deadline = std::chrono::seconds(60);
  options.fail_open = false;
  client::EpsClient client(options, attach);
  const absl::Status attached = client.Attach();
  RANK_CHECK(attached.ok(), "attach: %s", attached.ToString().c_str());

  SelectPolicy policy;
  policy.method = Method::kJl;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<int64_t> tokens(kBatch, kStartTokens);
  int64_t lists = 0, differing_lists = 0;
  std::vector<double> round_trips;
  const size_t slot_words = size_t{kLayers} * kv * layout.record_words;
  for (int step = 1; step <= flags.steps; ++step) {
    std::vector<v1::BatchRow> rows;
    std::vector<StepRow> step_rows;
    for (int r = 0; r < kBatch; ++r) {
      // Decode one token: append its keys to its group's summary on the host,
      // then copy the whole slot (every layer and KV head) to the device.
      const int64_t t = tokens[r]++;
      const int32_t slot = host.SlotOf(r, t / m.group_tokens());
      for (int layer = 0; layer < kLayers; ++layer) {
        for (int kvh = 0; kvh < kv; ++kvh) {
          if (t % m.group_tokens() == 0) (void)writer.Reset(host.Record(slot, layer, kvh));
          std::vector<float> key(kHeadDim);
          for (float& x : key) x = normal(rng);
          RANK_CHECK(writer
                         .Append(host.Record(slot, layer, kvh), layer, kvh,
                                 {key.data(), DType::kFloat32, 1, kHeadDim})
                         .ok(),
                     "append");
        }
      }
      RANK_CHECK(
          upload(pool + slot * slot_words * 4, host.Record(slot, 0, 0).data(), slot_words * 4),
          "slot upload");
      v1::BatchRow row;
      row.set_table_row(r);
      row.set_context_tokens(tokens[r]);
      rows.push_back(row);
      step_rows.push_back({.table_row = r, .context_tokens = tokens[r], .seq_id = 0});
    }
    for (int layer = 0; layer < kLayers; ++layer) {  // queries drift a little each step
      for (int r = 0; r < kBatch; ++r) {
        for (int h = 0; h < q; ++h) {
          for (float& x : host.Query(layer, r, h)) x += 0.05f * normal(rng);
        }
      }
    }
    RANK_CHECK(upload(queries, host_queries, query_count * 4), "queries upload");
    // A sync step's inputs must have landed before the call: cudaMemcpy from pageable
    // memory may return while its DMA is still in flight, and epsd (another process)
    // is not ordered after it.
    CUDA_CHECK(cudaDeviceSynchronize());

    RANK_CHECK(board->ArriveAndWait(step, std::chrono::seconds(60)),
               "step %d: another rank failed, or the barrier timed out", step);
    const client::StepResult result = client.SelectPages(step, rows);
    board->reply_us()[static_cast<size_t>(flags.rank) * flags.steps + (step - 1)] =
        testing::SteadyMicros();
    RANK_CHECK(!result.fallback && result.status.ok(), "step %d: %s", step,
               result.status.ToString().c_str());
    round_trips.push_back(result.round_trip_us);
    uint64_t done = 0;
    CUDA_CHECK(cudaMemcpy(&done, device + flags_at + 8, 8, cudaMemcpyDeviceToHost));
    RANK_CHECK(done == static_cast<uint64_t>(step), "step %d: selection_done=%llu", step,
               static_cast<unsigned long long>(done));

    StepStats stats;
    RANK_CHECK(reference->Select(host.Inputs(step_rows), policy, host.Outputs(), &stats).ok(),
               "reference");
    std::vector<int32_t> got_blocks(size_t{kLayers} * kBatch * host.max_blocks()),
        got_counts(kLayers * kBatch);
    CUDA_CHECK(cudaMemcpy(got_blocks.data(), device + visit, got_blocks.size() * 4,
                          cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_counts.data(), device + count, got_counts.size() * 4,
                          cudaMemcpyDeviceToHost));
    for (int layer = 0; layer < kLayers; ++layer) {
      for (int r = 0; r < kBatch; ++r) {
        ++lists;
        const auto want = host.VisitBlocks(layer, r);
        const int64_t index = int64_t{layer} * kBatch + r;
        RANK_CHECK(got_counts[index] >= 0, "step %d layer %d row %d: count %d", step, layer, r,
                   got_counts[index]);
        const std::vector<int32_t> got(
            got_blocks.begin() + index * host.max_blocks(),
            got_blocks.begin() + index * host.max_blocks() + got_counts[index]);
        if (std::vector<int32_t>(want.begin(), want.end()) == got) continue;
        // Only fp32 ties at a threshold may differ: a group or two, rarely.
        const int64_t n = GroupsFor(tokens[r], m);
        const auto a = testing::VisitedGroups(host, r, want, n);
        const auto c = testing::VisitedGroups(host, r, got, n);
        int differing = 0;
        double worst = 0.0;  // the largest relative distance of a differing group from a cut
        for (int64_t p = 0; p < n; ++p) {
          if (a[p] == c[p]) continue;
          ++differing;
          const double margin = CutMargin(m, *phi, host, policy, layer, r, n, p);
          worst = std::max(worst, std::abs(margin));
          std::fprintf(stderr,
                       "rank %d: step %d layer %d row %d group %lld: core %d, device %d, "
                       "score - cut = %.3g of the cut\n",
                       flags.rank, step, layer, r, static_cast<long long>(p), a[p], c[p], margin);
        }
        ++differing_lists;
        // Only groups at a cut within float rounding may differ (scores and cuts are
        // summed in another order on the device).
        RANK_CHECK(worst <= 1e-4,
                   "step %d layer %d row %d: %d groups differ from core/, "
                   "one %.3g of its cut away: more than float rounding",
                   step, layer, r, differing, worst);
      }
    }
  }
  RANK_CHECK(differing_lists <= lists / 100,
             "%lld of %lld lists differ from core/: more than fp32 ties explain",
             static_cast<long long>(differing_lists), static_cast<long long>(lists));
  std::printf(
      "rank %d of %d (device %d%s, %d KV heads): %d steps, %lld lists, %lld differ from "
      "core/ (fp32 ties); SelectPages p50 %.1f us p99 %.1f us\n",
      flags.rank, flags.ranks, d, flags.uuid ? " by uuid" : "", kv, flags.steps,
      static_cast<long long>(lists), static_cast<long long>(differing_lists),
      testing::Percentile(round_trips, 0.5), testing::Percentile(round_trips, 0.99));
  RANK_CHECK(client.Detach().ok(), "detach");
  cudaFree(device);
  return 0;
}

}  // namespace
}  // namespace eps

int main(int argc, char** argv) {
  eps::Flags flags;
  if (!eps::ParseArgs(argc, argv, &flags)) {
    std::fprintf(stderr, "rank_engine: bad flags (see the file comment)\n");
    return 2;
  }
  eps::testing::RankBoard* board =
      eps::testing::MapRankBoard(flags.board, flags.ranks, flags.steps, /*create=*/false);
  if (board == nullptr) {
    std::fprintf(stderr, "rank_engine: cannot map the board %s\n", flags.board.c_str());
    return 2;
  }
  const int rc = eps::Run(flags, board);
  std::fflush(stdout);
  eps::testing::UnmapRankBoard(board);
  return rc;
}
