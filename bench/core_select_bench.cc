// CPU scoring + selection of one decode step (the reference pre-pass), for a
// Llama-3-8B shape: 32 layers, 32 query heads, 8 KV heads, d = 128, g = 8, m = 8.
//
// Reports items/s as (sequence, layer, KV head, group) records scored per
// second and the summary bytes read per second.
#include <benchmark/benchmark.h>

#include <vector>

#include "core/phi.h"
#include "core/step.h"
#include "core/testing/synthetic.h"

namespace {

// The Llama-3-8B shape (m = 8) with g and the record parts of a benchmark.
eps::ModelLayout Llama3_8B(int group_blocks, eps::SummaryFeatures features) {
  eps::ModelLayout model;
  model.num_layers = 32;
  model.num_q_heads = 32;
  model.num_kv_heads = 8;
  model.head_dim = 128;
  model.group_blocks = group_blocks;
  model.sketch_dim = 8;
  model.features = features;
  return model;
}

void BM_SelectStepLlama3_8B(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const int64_t context = state.range(1);
  const eps::ModelLayout model =
      Llama3_8B(8, {.key_sum = false, .principal = false, .quest = false});
  auto phi = eps::PhiBank::Create(model.phi_seed, 32, 8, 128, 8);
  auto selector = eps::PageSelector::Create(model, *phi);
  eps::testing::StepBuffers buffers(model, batch, context, batch, eps::Granularity::kUnion);
  std::vector<eps::StepRow> rows;
  for (int b = 0; b < batch; ++b) {
    buffers.AssignRow(b, context, b);
    rows.push_back({.table_row = b, .context_tokens = context, .seq_id = 0});
  }
  buffers.FillRandomSummaries(1);
  eps::SelectPolicy policy;
  // docs/benchmarks/core.md's tables: jl (the minimal records carry no quest part) and
  // top_pages 16 at g = 8, as before epsd's defaults became questclt and 64 groups of g = 2.
  policy.method = eps::Method::kJl;
  policy.top_pages = 16;
  eps::StepStats stats;
  for (auto _ : state) {
    const absl::Status status =
        selector->Select(buffers.Inputs(rows), policy, buffers.Outputs(), &stats);
    if (!status.ok()) state.SkipWithError(status.ToString().c_str());
  }
  const int64_t records = static_cast<int64_t>(batch) * eps::GroupsFor(context, model) * 32 * 8;
  state.SetItemsProcessed(state.iterations() * records);
  state.SetBytesProcessed(state.iterations() * stats.summary_bytes_read);
  state.counters["groups_visited_pct"] = 100.0 * stats.groups_visited / stats.groups_total;
}

BENCHMARK(BM_SelectStepLlama3_8B)
    ->ArgNames({"batch", "context"})
    ->ArgsProduct({{1, 8}, {8192, 32768, 131072}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// epsd's defaults (questclt, g = 2, top_pages 64) on the cpu backend, with questclt
// reading the binary16 quest part (quest8 = 0) or the quest8 part (quest8 = 1).
void BM_QuestCltStepLlama3_8B(benchmark::State& state) {
  const int64_t context = state.range(0);
  const eps::ModelLayout model = Llama3_8B(
      2, {.key_sum = false, .principal = false, .quest = true, .quest8 = state.range(1) != 0});
  auto phi = eps::PhiBank::Create(model.phi_seed, 32, 8, 128, 8);
  auto selector = eps::PageSelector::Create(model, *phi);
  eps::testing::StepBuffers buffers(model, 1, context, 1, eps::Granularity::kUnion);
  buffers.AssignRow(0, context, 0);
  const std::vector<eps::StepRow> rows = {{.table_row = 0, .context_tokens = context, .seq_id = 0}};
  buffers.FillRandomSummaries(1);
  eps::SelectPolicy policy;  // questclt, top_pages 64
  eps::StepStats stats;
  for (auto _ : state) {
    const absl::Status status =
        selector->Select(buffers.Inputs(rows), policy, buffers.Outputs(), &stats);
    if (!status.ok()) state.SkipWithError(status.ToString().c_str());
  }
  state.SetItemsProcessed(state.iterations() * eps::GroupsFor(context, model) * 32 * 8);
  state.counters["groups_visited_pct"] = 100.0 * stats.groups_visited / stats.groups_total;
}

BENCHMARK(BM_QuestCltStepLlama3_8B)
    ->ArgNames({"context", "quest8"})
    ->ArgsProduct({{8192, 32768}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
