#include "core/testing/synthetic.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace eps::testing {

ModelLayout DemoModel() {
  ModelLayout model;
  model.num_layers = 2;
  model.num_q_heads = 8;
  model.num_kv_heads = 2;
  model.head_dim = 128;
  model.phi_seed = 42;
  model.features = {.key_sum = true, .principal = true, .quest = true};
  return model;
}

void ApplyRope(std::span<float> v, int64_t pos, float base) {
  const int half = static_cast<int>(v.size() / 2);
  for (int i = 0; i < half; ++i) {
    const double theta = static_cast<double>(pos) * std::pow(base, -2.0 * i / v.size());
    const double c = std::cos(theta), s = std::sin(theta);
    const double a = v[i], b = v[i + half];
    v[i] = static_cast<float>(a * c - b * s);
    v[i + half] = static_cast<float>(a * s + b * c);
  }
}

SyntheticHead MakeSyntheticHead(const SyntheticConfig& c) {
  const int d = c.head_dim;
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  auto gaussian = [&](std::vector<float>& v, float scale) {
    for (float& x : v) x = normal(rng) * scale;
  };

  std::vector<float> channel_scale(d, 1.0f);
  for (float& s : channel_scale) {
    if (uniform(rng) < c.outlier_fraction) s = 4.0f;
  }
  std::vector<float> mean0(d), drift_a(d), drift_b(d);
  gaussian(mean0, 0.5f);
  gaussian(drift_a, c.drift);
  gaussian(drift_b, c.drift);

  SyntheticHead head;
  // Queries: a shared direction plus a per-head deviation, norm sqrt(d).
  std::vector<float> shared(d), q(d);
  gaussian(shared, 1.0f);
  head.queries.resize(static_cast<size_t>(c.num_queries) * d);
  for (int h = 0; h < c.num_queries; ++h) {
    for (int i = 0; i < d; ++i) q[i] = shared[i] + c.query_spread * normal(rng);
    float n2 = 0;
    for (float x : q) n2 += x * x;
    const float scale = std::sqrt(static_cast<float>(d) / n2);
    for (int i = 0; i < d; ++i) head.queries[h * d + i] = q[i] * scale * channel_scale[i] / 2;
    ApplyRope({head.queries.data() + h * d, static_cast<size_t>(d)}, c.tokens, c.rope_base);
  }
  // The direction needles and sinks align with: the mean of the queries.
  std::vector<float> target(d, 0.0f);
  for (int h = 0; h < c.num_queries; ++h) {
    for (int i = 0; i < d; ++i) target[i] += head.queries[h * d + i];
  }
  float t2 = 0;
  for (float x : target) t2 += x * x;
  const float qnorm = std::sqrt(t2) / c.num_queries;
  for (float& x : target) x /= std::sqrt(t2);  // unit

  head.keys.resize(static_cast<size_t>(c.tokens) * d);
  const double period = std::max<double>(2048.0, c.tokens / 3.0);
  std::vector<float> k(d);
  for (int64_t t = 0; t < c.tokens; ++t) {
    const float ca = static_cast<float>(std::cos(2 * M_PI * t / period));
    const float sb = static_cast<float>(std::sin(2 * M_PI * t / period));
    for (int i = 0; i < d; ++i) {
      k[i] = (mean0[i] + ca * drift_a[i] + sb * drift_b[i] + normal(rng)) * channel_scale[i];
    }
    ApplyRope(k, t, c.rope_base);
    std::copy(k.begin(), k.end(), head.keys.begin() + t * d);
  }
  // Needles and sinks: keys along `target` with a chosen logit q·k/sqrt(d).
  auto plant = [&](int64_t t, float logit) {
    const float along = logit * std::sqrt(static_cast<float>(d)) / qnorm;
    for (int i = 0; i < d; ++i) {
      head.keys[t * d + i] = 0.3f * head.keys[t * d + i] + along * target[i];
    }
  };
  for (int64_t t = 0; t < std::min<int64_t>(c.num_sinks, c.tokens); ++t) plant(t, c.sink_logit);
  std::uniform_int_distribution<int64_t> position(c.num_sinks,
                                                  std::max<int64_t>(c.num_sinks, c.tokens - 1));
  for (int n = 0; n < c.num_needles && c.tokens > c.num_sinks; ++n) {
    const int64_t t = position(rng);
    head.needles.push_back(t);
    plant(t, c.needle_logit);
  }
  std::sort(head.needles.begin(), head.needles.end());
  std::uniform_int_distribution<int64_t> span_length(16, std::max(16, c.max_span_tokens));
  std::uniform_real_distribution<float> span_logit(2.0f, std::max(2.0f, c.max_span_logit));
  for (int n = 0; n < c.num_spans && c.tokens > c.num_sinks; ++n) {
    const int64_t begin = position(rng);
    const int64_t end = std::min(c.tokens, begin + span_length(rng));
    const float logit = span_logit(rng);
    for (int64_t t = begin; t < end; ++t) plant(t, logit + 0.5f * normal(rng));
    head.spans.emplace_back(begin, end);
  }
  return head;
}

std::vector<double> GroupAttentionMass(std::span<const float> keys, std::span<const float> query,
                                       int head_dim, int group_tokens) {
  const int64_t tokens = static_cast<int64_t>(keys.size()) / head_dim;
  std::vector<double> logits(tokens);
  double top = -1e300;
  for (int64_t t = 0; t < tokens; ++t) {
    double dot = 0;
    for (int i = 0; i < head_dim; ++i) dot += double{query[i]} * keys[t * head_dim + i];
    logits[t] = dot / std::sqrt(static_cast<double>(head_dim));
    top = std::max(top, logits[t]);
  }
  std::vector<double> mass((tokens + group_tokens - 1) / group_tokens, 0.0);
  double total = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const double w = std::exp(logits[t] - top);
    mass[t / group_tokens] += w;
    total += w;
  }
  for (double& m : mass) m /= total;
  return mass;
}

std::vector<double> GroupMaxScore(std::span<const float> keys, std::span<const float> query,
                                  int head_dim, int group_tokens) {
  const int64_t tokens = static_cast<int64_t>(keys.size()) / head_dim;
  std::vector<double> best((tokens + group_tokens - 1) / group_tokens, -1e300);
  for (int64_t t = 0; t < tokens; ++t) {
    double dot = 0;
    for (int i = 0; i < head_dim; ++i) dot += double{query[i]} * keys[t * head_dim + i];
    best[t / group_tokens] = std::max(best[t / group_tokens], dot);
  }
  return best;
}

StepBuffers::StepBuffers(const ModelLayout& model, int64_t max_seqs, int64_t max_context,
                         int64_t max_batch, Granularity granularity)
    : model_(model),
      layout_(SummaryLayout::For(model)),
      max_seqs_(max_seqs),
      max_blocks_(BlocksFor(max_context, model.block_size)),
      max_groups_(GroupsFor(max_context, model)),
      max_batch_(max_batch),
      num_slots_(max_seqs * GroupsFor(max_context, model)),
      lists_(granularity == Granularity::kPerKvHead ? model.num_kv_heads : 1) {
  pool_.assign(static_cast<size_t>(num_slots_) * model.num_layers * model.num_kv_heads *
                   layout_.record_words,
               0.0f);
  group_table_.assign(max_seqs_ * max_groups_, 0);
  block_table_.assign(max_seqs_ * max_blocks_, 0);
  queries_.assign(
      static_cast<size_t>(model.num_layers) * max_batch * model.num_q_heads * model.head_dim, 0.0f);
  visit_blocks_.assign(model.num_layers * max_batch * lists_ * max_blocks_, -1);
  visit_count_.assign(model.num_layers * max_batch * lists_, -1);
}

void StepBuffers::AssignRow(int32_t row, int64_t tokens, uint64_t seed) {
  const int64_t groups = GroupsFor(tokens, model_);
  for (int64_t p = 0; p < groups; ++p) group_table_[row * max_groups_ + p] = row * max_groups_ + p;
  std::vector<int32_t> blocks(max_blocks_);
  std::iota(blocks.begin(), blocks.end(), static_cast<int32_t>(row * max_blocks_));
  std::mt19937_64 rng(seed);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  std::copy(blocks.begin(), blocks.end(), block_table_.begin() + row * max_blocks_);
}

std::span<float> StepBuffers::Record(int64_t slot, int layer, int kv_head) {
  const int64_t index = (slot * model_.num_layers + layer) * model_.num_kv_heads + kv_head;
  return {pool_.data() + index * layout_.record_words, static_cast<size_t>(layout_.record_words)};
}

std::span<float> StepBuffers::Query(int layer, int64_t batch_pos, int q_head) {
  const int64_t index = (layer * max_batch_ + batch_pos) * model_.num_q_heads + q_head;
  return {queries_.data() + index * model_.head_dim, static_cast<size_t>(model_.head_dim)};
}

void StepBuffers::FillRandomSummaries(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uniform(0.1f, 1.0f);
  const int64_t records = static_cast<int64_t>(pool_.size()) / layout_.record_words;
  const int m = model_.sketch_dim;
  for (int64_t r = 0; r < records; ++r) {
    float* rec = pool_.data() + r * layout_.record_words;
    for (int i = 0; i < m; ++i) {
      for (int j = i; j < m; ++j) rec[PackedIndex(m, i, j)] = i == j ? 10 * uniform(rng) : 0.1f;
    }
    rec[layout_.fro2] = 100 * uniform(rng);
    rec[layout_.max_norm] = std::sqrt(rec[layout_.fro2]);
    rec[layout_.count] = static_cast<float>(model_.group_tokens());
    if (layout_.key_sum >= 0) {
      for (int i = 0; i < model_.head_dim; ++i) rec[layout_.key_sum + i] = uniform(rng) - 0.5f;
    }
    if (layout_.quest_min >= 0) {
      uint16_t* lo = reinterpret_cast<uint16_t*>(rec + layout_.quest_min);  // binary16 pairs
      uint16_t* hi = reinterpret_cast<uint16_t*>(rec + layout_.quest_max);
      for (int i = 0; i < model_.head_dim; ++i) {
        lo[i] = FloatToHalfDown(-uniform(rng));
        hi[i] = FloatToHalfUp(uniform(rng));
      }
    }
    if (layout_.quest8 >= 0) {  // the same range, in codes of the power-of-two scale 1/128
      int8_t* lo = reinterpret_cast<int8_t*>(rec + layout_.quest8);
      int8_t* hi = lo + model_.head_dim;
      for (int i = 0; i < model_.head_dim; ++i) {
        lo[i] = static_cast<int8_t>(std::floor(-127.0f * uniform(rng)));
        hi[i] = static_cast<int8_t>(std::ceil(127.0f * uniform(rng)));
      }
      rec[layout_.quest8 + model_.head_dim / 2] = 1.0f / 128.0f;
    }
  }
  for (float& q : queries_) q = uniform(rng) - 0.5f;
}

StepInputs StepBuffers::Inputs(std::span<const StepRow> rows) const {
  StepInputs in;
  in.summary_pool = pool_.data();
  in.num_slots = num_slots_;
  in.group_table = group_table_.data();
  in.block_table = block_table_.data();
  in.max_seqs = max_seqs_;
  in.max_groups = max_groups_;
  in.max_blocks = max_blocks_;
  in.num_physical_blocks = max_seqs_ * max_blocks_;
  in.queries = queries_.data();
  in.query_dtype = DType::kFloat32;
  in.max_batch = max_batch_;
  in.rows = rows;
  return in;
}

StepOutputs StepBuffers::Outputs() { return {visit_blocks_.data(), visit_count_.data()}; }

std::span<const int32_t> StepBuffers::VisitBlocks(int layer, int64_t batch_pos, int list) const {
  const int64_t index = (layer * max_batch_ + batch_pos) * lists_ + list;
  return {visit_blocks_.data() + index * max_blocks_, static_cast<size_t>(visit_count_[index])};
}

int32_t StepBuffers::VisitCount(int layer, int64_t batch_pos, int list) const {
  return visit_count_[(layer * max_batch_ + batch_pos) * lists_ + list];
}

}  // namespace eps::testing
