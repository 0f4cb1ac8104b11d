#include "load/workload.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "core/phi.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"

namespace eps::load {
namespace {

// log Σ exp(q·k/√d) over keys [tokens, d], with the maximum taken out (always finite).
float LogSumExp(const float* keys, int64_t tokens, const float* query, int d) {
  std::vector<double> scores(tokens);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t t = 0; t < tokens; ++t) {
    double dot = 0;
    for (int i = 0; i < d; ++i) dot += static_cast<double>(query[i]) * keys[t * d + i];
    scores[t] = dot * scale;
  }
  const double max = *std::max_element(scores.begin(), scores.end());
  double sum = 0;
  for (double s : scores) sum += std::exp(s - max);
  return static_cast<float>(max + std::log(sum));
}

}  // namespace

absl::Status WorkloadImage::WriteTo(BufferSet& buffers) const {
  if (absl::Status s = buffers.WriteSummaryPool(summary_pool); !s.ok()) return s;
  if (absl::Status s = buffers.WriteGroupTable(group_table); !s.ok()) return s;
  if (absl::Status s = buffers.WriteBlockTable(block_table); !s.ok()) return s;
  if (max_coarse_groups > 0) {
    if (absl::Status s = buffers.WriteCoarsePool(coarse_pool); !s.ok()) return s;
    if (absl::Status s = buffers.WriteCoarseTable(coarse_table); !s.ok()) return s;
  }
  return buffers.WriteQueries(queries);
}

WorkloadImage BuildWorkload(const ModelLayout& model, int batch, int64_t max_context, uint64_t seed,
                            double feedback_share, int patterns) {
  WorkloadImage w;
  const SummaryLayout layout = SummaryLayout::For(model);
  const int d = model.head_dim, words = layout.record_words;
  const int pairs = model.num_layers * model.num_kv_heads;
  patterns = std::clamp(patterns, 1, pairs);
  w.max_blocks = BlocksFor(max_context, model.block_size);
  w.max_groups = GroupsFor(max_context, model);
  w.max_coarse_groups = CoarseGroupsFor(max_context, model);
  w.shape = {.num_slots = batch * w.max_groups,
             .max_seqs = batch,
             .max_context = max_context,
             .max_batch = batch,
             .coarse_slots = batch * w.max_coarse_groups,
             .with_feedback = feedback_share > 0};
  std::mt19937_64 rng(seed);

  // Records of every group of each pattern: [patterns, max_groups, words].
  const PhiBank phi =
      *PhiBank::Create(model.phi_seed, model.num_layers, model.num_kv_heads, d, model.sketch_dim);
  const SummaryWriter writer(model, phi);
  const int64_t gt = model.group_tokens();
  const int64_t ct = int64_t{model.coarse_blocks} * model.block_size;  // 0 without the level
  std::vector<float> records(static_cast<size_t>(patterns) * w.max_groups * words, 0.0f);
  std::vector<float> coarse_records(static_cast<size_t>(patterns) * w.max_coarse_groups * words,
                                    0.0f);
  std::vector<std::vector<float>> pattern_queries;  // [gqa, d] per pattern
  const int ratio = model.gqa_ratio();
  // With feedback: every group's log-sum-exp per pattern and query, [patterns, gqa, max_groups].
  std::vector<float> group_lse;
  for (int p = 0; p < patterns; ++p) {
    const int layer = p / model.num_kv_heads, kvh = p % model.num_kv_heads;
    testing::SyntheticConfig c;
    c.head_dim = d;
    c.tokens = max_context;
    c.num_queries = model.gqa_ratio();
    c.seed = rng();
    const testing::SyntheticHead head = testing::MakeSyntheticHead(c);
    // Well-formed synthetic keys cannot be rejected; a failure here is a bug.
    const auto write_level = [&](std::vector<float>& level, int64_t count, int64_t tokens) {
      for (int64_t r = 0; r < count; ++r) {
        std::span<float> record(level.data() + (p * count + r) * words, words);
        (void)writer.Reset(record);  // sized by the layout
        const int64_t begin = r * tokens, n = std::min(tokens, max_context - begin);
        (void)writer.Append(record, layer, kvh,
                            {head.keys.data() + begin * d, DType::kFloat32, n, d});
      }
    };
    write_level(records, w.max_groups, gt);
    // The coarse records of the same keys (coarse group c: tokens [c*ct, (c+1)*ct)).
    write_level(coarse_records, w.max_coarse_groups, ct);
    pattern_queries.push_back(head.queries);
    if (feedback_share > 0) {
      for (int i = 0; i < ratio; ++i) {
        for (int64_t g = 0; g < w.max_groups; ++g) {
          const int64_t begin = g * gt, n = std::min(gt, max_context - begin);
          group_lse.push_back(
              LogSumExp(head.keys.data() + begin * d, n, head.queries.data() + i * d, d));
        }
      }
    }
  }

  // Each slot's records: its group's (slot % groups) record of pattern pair % patterns.
  const auto tile = [&](const std::vector<float>& level, int64_t count, int64_t slots,
                        std::vector<float>& pool) {
    pool.resize(static_cast<size_t>(slots) * pairs * words);
    for (int64_t slot = 0; slot < slots; ++slot) {
      for (int pair = 0; pair < pairs; ++pair) {
        std::copy_n(level.data() + ((pair % patterns) * count + slot % count) * words, words,
                    pool.data() + (slot * pairs + pair) * words);
      }
    }
  };
  tile(records, w.max_groups, w.shape.num_slots, w.summary_pool);
  tile(coarse_records, w.max_coarse_groups, w.shape.coarse_slots, w.coarse_pool);
  w.coarse_table.resize(static_cast<size_t>(batch) * w.max_coarse_groups);
  std::iota(w.coarse_table.begin(), w.coarse_table.end(), 0);
  w.group_table.resize(static_cast<size_t>(batch) * w.max_groups);
  std::iota(w.group_table.begin(), w.group_table.end(), 0);
  w.block_table.resize(static_cast<size_t>(batch) * w.max_blocks);
  std::iota(w.block_table.begin(), w.block_table.end(), 0);
  std::shuffle(w.block_table.begin(), w.block_table.end(), rng);
  w.num_kv_blocks = static_cast<int64_t>(w.block_table.size());

  w.queries.resize(static_cast<size_t>(model.num_layers) * batch * model.num_q_heads * d);
  for (int layer = 0; layer < model.num_layers; ++layer) {
    for (int pos = 0; pos < batch; ++pos) {
      for (int h = 0; h < model.num_q_heads; ++h) {
        const int pair = layer * model.num_kv_heads + h / ratio;
        const std::vector<float>& q = pattern_queries[pair % patterns];
        std::copy_n(q.data() + (h % ratio) * d, d,
                    w.queries.data() +
                        ((static_cast<int64_t>(layer) * batch + pos) * model.num_q_heads + h) * d);
      }
    }
  }
  if (feedback_share > 0) {
    // Group g of a (layer, row) with phase φ is fed when ⌊(g+1)F + φ⌋ > ⌊gF + φ⌋: any
    // prefix of n groups then holds ⌊nF⌋ or ⌈nF⌉ fed ones, whatever the step's context. A
    // generator of its own, so that the other images are those of a run without feedback.
    std::mt19937_64 phase_rng(seed ^ 0x5eedfeedbac4ULL);
    std::uniform_real_distribution<double> phase_of(0.0, 1.0);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const int q_heads = model.num_q_heads;
    w.feedback.assign(static_cast<size_t>(model.num_layers) * batch * q_heads * w.max_groups, nan);
    for (int layer = 0; layer < model.num_layers; ++layer) {
      for (int row = 0; row < batch; ++row) {
        const double phase = phase_of(phase_rng);
        for (int64_t g = 0; g < w.max_groups; ++g) {
          if (std::floor((g + 1) * feedback_share + phase) ==
              std::floor(g * feedback_share + phase)) {
            continue;
          }
          for (int h = 0; h < q_heads; ++h) {
            const int pattern = (layer * model.num_kv_heads + h / ratio) % patterns;
            w.feedback[((static_cast<int64_t>(layer) * batch + row) * q_heads + h) * w.max_groups +
                       g] = group_lse[(pattern * ratio + h % ratio) * w.max_groups + g];
          }
        }
      }
    }
  }
  return w;
}

}  // namespace eps::load
