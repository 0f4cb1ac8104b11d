// Demo of core/ selecting pages on a synthetic long-context workload.
//
// Builds EPS summaries for every (sequence, layer, KV head) of a small GQA
// model from synthetic keys (RoPE, outlier channels, drift, sinks, needles),
// runs one decode step's selection with each method, and prints the groups
// visited and the softmax attention mass those groups hold (recall).
//
// exit: 0 done; 1 an error (out of memory included); 2 bad usage.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "cli/flags.h"
#include "core/phi.h"
#include "core/status.h"
#include "core/step.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"

// The same names, types and units as epsd's and eps-load's flags (docs/cli.md).
ABSL_FLAG(eps::cli::Size, context, {32768}, "tokens per sequence (16k, 32k, ...)");
ABSL_FLAG(eps::cli::Size, batch, {2}, "sequences, in [1, 4k]");
ABSL_FLAG(uint64_t, seed, 7, "synthetic keys");
ABSL_FLAG(int, eps_top_pages, 64, "top_pages M, in [1, 2^30]");
ABSL_FLAG(double, eps_alpha, 1.0, "visit groups scoring >= T/alpha, in [1, 1e6]");
ABSL_FLAG(int, eps_dim, 8, "sketch dimension m, in [1, 64]");
ABSL_FLAG(int, eps_group_blocks, 2, "blocks per summary group g, in [1, 1024]");
static const eps::cli::FlagAlias kTopPages("top-pages", "eps-top-pages");
static const eps::cli::FlagAlias kAlpha("alpha", "eps-alpha");
static const eps::cli::FlagAlias kGroupBlocks("group-blocks", "eps-group-blocks");

namespace {

using eps::testing::SyntheticConfig;
using eps::testing::SyntheticHead;

struct Args {
  int64_t context = 0;
  int batch = 0;
  uint64_t seed = 0;
  int top_pages = 0;
  float alpha = 0;
  int sketch_dim = 0;
  int group_blocks = 0;
};

eps::ModelLayout ModelFor(const Args& a) {
  eps::ModelLayout model = eps::testing::DemoModel();
  model.sketch_dim = a.sketch_dim;
  model.group_blocks = a.group_blocks;
  return model;
}

// What the run will hold, against this machine's memory: the summary pool, the
// attention mass per (row, layer, q head, block), and one head's synthetic keys at a
// time. A run that cannot fit is refused here rather than ending in std::bad_alloc.
absl::Status CheckMemory(const Args& a) {
  const eps::ModelLayout model = ModelFor(a);
  const double rows = a.batch;
  const double pool = rows * static_cast<double>(eps::GroupsFor(a.context, model)) *
                      model.num_layers * model.num_kv_heads *
                      static_cast<double>(eps::SummaryLayout::For(model).record_bytes());
  const double mass = rows * model.num_layers * model.num_q_heads *
                      static_cast<double>(eps::BlocksFor(a.context, model.block_size)) *
                      sizeof(double);
  const double keys = 2.0 * static_cast<double>(a.context) * model.head_dim * sizeof(float);
  const double need = pool + mass + keys;
  const double have = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  if (need > have) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--batch=%d with --context=%d needs about %.0f bytes (%.1f GiB), more than this "
        "machine's %.1f GiB of memory",
        a.batch, a.context, need, need / (1 << 30), have / (1 << 30)));
  }
  return absl::OkStatus();
}

absl::StatusOr<Args> ReadFlags() {
  Args a;
  RETURN_IF_ERROR(eps::cli::ReadInRange(FLAGS_context, int64_t{1}, int64_t{1} << 24, &a.context));
  RETURN_IF_ERROR(eps::cli::ReadInRange(FLAGS_batch, 1, 4096, &a.batch));
  a.seed = absl::GetFlag(FLAGS_seed);
  RETURN_IF_ERROR(eps::cli::ReadInRange(FLAGS_eps_top_pages, 1, 1 << 30, &a.top_pages));
  double alpha = 0;
  RETURN_IF_ERROR(eps::cli::ReadInRange(FLAGS_eps_alpha, 1.0, 1e6, &alpha));
  a.alpha = static_cast<float>(alpha);
  RETURN_IF_ERROR(eps::cli::ReadInRange(FLAGS_eps_dim, 1, 64, &a.sketch_dim));
  RETURN_IF_ERROR(eps::cli::ReadInRange(FLAGS_eps_group_blocks, 1, 1024, &a.group_blocks));
  RETURN_IF_ERROR(CheckMemory(a));
  return a;
}

// The whole run; main catches a std::bad_alloc from it.
int Run(const Args& args) {
  const eps::ModelLayout model = ModelFor(args);
  auto phi = eps::PhiBank::Create(model.phi_seed, model.num_layers, model.num_kv_heads,
                                  model.head_dim, model.sketch_dim);
  auto selector = eps::PageSelector::Create(model, *phi);
  if (!phi.ok() || !selector.ok()) {
    std::fprintf(stderr, "setup failed\n");
    return 1;
  }
  eps::SummaryWriter writer(model, *phi);
  eps::testing::StepBuffers buffers(model, args.batch, args.context, args.batch,
                                    eps::Granularity::kUnion);
  const int d = model.head_dim;
  const int ratio = model.gqa_ratio();
  const int64_t group_tokens = model.group_tokens();
  const int64_t groups = eps::GroupsFor(args.context, model);
  // mass[(row, layer, q_head)][logical block]
  std::vector<std::vector<double>> block_mass;
  std::printf("epsd core demo: %d layers, %d q heads, %d kv heads, d=%d, block=%d, g=%d, m=%d\n",
              model.num_layers, model.num_q_heads, model.num_kv_heads, d, model.block_size,
              model.group_blocks, model.sketch_dim);
  std::printf("top_pages=%d alpha=%.2f\n", args.top_pages, args.alpha);
  std::printf("batch=%d context=%lld tokens (%lld groups per sequence), seed=%llu\n", args.batch,
              static_cast<long long>(args.context), static_cast<long long>(groups),
              static_cast<unsigned long long>(args.seed));

  std::vector<eps::StepRow> rows;
  for (int row = 0; row < args.batch; ++row) {
    buffers.AssignRow(row, args.context, args.seed + row);
    rows.push_back({.table_row = row, .context_tokens = args.context, .seq_id = 1000u + row});
    for (int layer = 0; layer < model.num_layers; ++layer) {
      for (int kvh = 0; kvh < model.num_kv_heads; ++kvh) {
        SyntheticConfig config;
        config.head_dim = d;
        config.tokens = args.context;
        config.num_queries = ratio;
        config.num_needles = (row + layer + kvh) % 3 == 2 ? 0 : 1 + (layer + kvh) % 4;
        config.seed = args.seed * 1000003 + row * 1009 + layer * 31 + kvh;
        const SyntheticHead head = eps::testing::MakeSyntheticHead(config);
        for (int64_t p = 0; p < groups; ++p) {
          const int64_t begin = p * group_tokens;
          const int64_t count = std::min(group_tokens, args.context - begin);
          const eps::KeyRows keys{head.keys.data() + begin * d, eps::DType::kFloat32, count, d};
          const auto record = buffers.Record(buffers.SlotOf(row, p), layer, kvh);
          (void)writer.Reset(record);  // sized by the layout
          if (!writer.Append(record, layer, kvh, keys).ok() ||
              !writer.Seal(record, layer, kvh, keys).ok()) {
            std::fprintf(stderr, "summary write failed\n");
            return 1;
          }
        }
        for (int r = 0; r < ratio; ++r) {
          const std::span<const float> q(head.queries.data() + r * d, d);
          std::copy(q.begin(), q.end(), buffers.Query(layer, row, kvh * ratio + r).begin());
          block_mass.push_back(eps::testing::GroupAttentionMass(head.keys, q, d, model.block_size));
        }
      }
    }
  }

  struct Variant {
    std::string name;
    eps::SelectPolicy policy;
  };
  std::vector<Variant> variants;
  for (eps::Method method : {eps::Method::kOff, eps::Method::kJl, eps::Method::kOnePc,
                             eps::Method::kFro, eps::Method::kQuest, eps::Method::kQuestClt}) {
    eps::SelectPolicy policy;
    policy.method = method;
    policy.top_pages = args.top_pages;
    policy.alpha = args.alpha;
    variants.push_back({eps::MethodName(method), policy});
  }
  eps::SelectPolicy strict;
  strict.strict = true;
  strict.top_pages = args.top_pages;
  variants.push_back({"strict", strict});
  eps::SelectPolicy fixed;
  fixed.budget = eps::Budget::kFixed;
  fixed.top_pages = args.top_pages;
  variants.push_back({"jl+fixed", fixed});

  std::printf("\n%-10s %16s %10s %12s %12s %12s\n", "method", "groups visited", "visited%",
              "KV read%", "recall mean", "recall min");
  for (const Variant& v : variants) {
    eps::StepStats stats;
    const absl::Status status =
        selector->Select(buffers.Inputs(rows), v.policy, buffers.Outputs(), &stats);
    if (!status.ok()) {
      std::fprintf(stderr, "%s: %s\n", v.name.c_str(), status.ToString().c_str());
      return 1;
    }
    double recall_sum = 0, recall_min = 1;
    int heads = 0;
    for (int row = 0; row < args.batch; ++row) {
      std::unordered_map<int32_t, int64_t> logical;  // physical -> logical block
      const auto block_row = buffers.BlockRow(row);
      for (int64_t b = 0; b < buffers.max_blocks(); ++b) logical[block_row[b]] = b;
      for (int layer = 0; layer < model.num_layers; ++layer) {
        const auto visited = buffers.VisitBlocks(layer, row);
        for (int h = 0; h < model.num_q_heads; ++h) {
          const auto& mass = block_mass[(row * model.num_layers + layer) * model.num_q_heads + h];
          double recall = 0;
          for (int32_t block : visited) recall += mass[logical[block]];
          recall_sum += recall;
          recall_min = std::min(recall_min, recall);
          ++heads;
        }
      }
    }
    std::printf(
        "%-10s %7lld / %-6lld %9.1f%% %11.1f%% %12.4f %12.4f\n", v.name.c_str(),
        static_cast<long long>(stats.groups_visited), static_cast<long long>(stats.groups_total),
        100.0 * stats.groups_visited / stats.groups_total,
        100.0 * stats.kv_bytes_read_est / stats.kv_bytes_dense, recall_sum / heads, recall_min);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<Args> read;
  const int done = eps::cli::ParseMain(argc, argv, "eps_core_demo", "eps_core_demo [flags]", [&] {
    read = ReadFlags();
    return read.status();
  });
  if (done >= 0) return done;
  try {
    return Run(*read);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "eps_core_demo: out of memory (--batch=%d, --context=%lld)\n", read->batch,
                 static_cast<long long>(read->context));
    return 1;
  }
}
