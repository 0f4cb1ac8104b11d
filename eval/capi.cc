// A C ABI over the shipped core/ code, for the Python evaluation harness
// (eval/eps_eval/core.py loads it with ctypes).
//
// An EvalSequence is one sequence of one layer: its keys, its summary records
// (core/summary.h, sealed as groups fill) and a PageSelector over them. The
// harness appends keys as a decode would, then asks for
//   - scores of every group for every query head (core/bounds.h),
//   - visit marks from given scores under a top_pages sweep (core/select.h:
//     MarkForced + MarkByThreshold, OR-ed per list as PageSelector does),
//   - the whole reference step (PageSelector::Select, core/step.h) under any budget
//     of core/select.h (EvalBudget below; threshold when none is given), which the
//     harness uses for strict mode, the coarse level, feedback and list budgets, and
//     to cross-check the two calls above.
// Besides, the quest8 scale core's writer stores for a group's largest key magnitude
// (Quest8ScaleFor, core/summary.h), for the harness's own quest8 tables (quality.py).
// Every function returns 0 on success or -1 with a message in `err`.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/bounds.h"
#include "core/layout.h"
#include "core/phi.h"
#include "core/select.h"
#include "core/step.h"
#include "core/summary.h"

namespace eps::eval {
namespace {

int Fail(const absl::Status& status, char* err, int err_len) {
  if (err != nullptr && err_len > 0) {
    const std::string msg(status.message());
    const size_t n = std::min(msg.size(), static_cast<size_t>(err_len - 1));
    std::memcpy(err, msg.data(), n);
    err[n] = '\0';
  }
  return -1;
}

SummaryFeatures FeaturesFromMask(int mask) {
  return {.key_sum = (mask & 1) != 0,
          .principal = (mask & 2) != 0,
          .quest = (mask & 4) != 0,
          .quest8 = (mask & 8) != 0};
}

// Writes one budget's lists out_i [lists, n]: the forced groups, then every query
// head's marks OR-ed into its list (its KV head's, or the one union list).
template <typename MarkHead>
void MarkLists(int64_t n, int q_heads, int kv_heads, bool per_kv_head,
               const std::vector<uint8_t>& forced, uint8_t* out_i, MarkHead mark_head) {
  const int ratio = q_heads / kv_heads;
  const int lists = per_kv_head ? kv_heads : 1;
  for (int list = 0; list < lists; ++list) {
    std::copy(forced.begin(), forced.end(), out_i + static_cast<size_t>(list) * n);
  }
  for (int h = 0; h < q_heads; ++h) {
    const int list = per_kv_head ? h / ratio : 0;
    mark_head(h, std::span<uint8_t>(out_i + static_cast<size_t>(list) * n, n));
  }
}

// Parses a core enum by the name core prints for it (BudgetName, MassScopeName), so the
// names stay core's: one table, read by both sides.
template <typename Enum, typename NameOf>
bool ParseByName(const char* name, std::initializer_list<Enum> values, NameOf name_of, Enum* out) {
  for (Enum v : values) {
    if (std::strcmp(name, name_of(v)) == 0) {
      *out = v;
      return true;
    }
  }
  return false;
}

}  // namespace

// One layer of one sequence: summaries in a pool, the open group's keys for Seal.
class EvalSequence {
 public:
  static absl::StatusOr<std::unique_ptr<EvalSequence>> Create(const ModelLayout& model,
                                                              int64_t max_tokens) {
    if (absl::Status s = model.Validate(); !s.ok()) return s;
    if (model.num_layers != 1) return absl::InvalidArgumentError("an EvalSequence has one layer");
    if (max_tokens < 1) {
      return absl::InvalidArgumentError("max_tokens=" + std::to_string(max_tokens) + " < 1");
    }
    absl::StatusOr<PhiBank> phi =
        PhiBank::Create(model.phi_seed, 1, model.num_kv_heads, model.head_dim, model.sketch_dim);
    if (!phi.ok()) return phi.status();
    return std::unique_ptr<EvalSequence>(new EvalSequence(model, max_tokens, *std::move(phi)));
  }

  // keys: [kv_heads, n, d] fp32.
  absl::Status Append(const float* keys, int64_t n) {
    if (n < 0 || tokens_ + n > max_tokens_) {
      return absl::InvalidArgumentError("append of " + std::to_string(n) + " keys to " +
                                        std::to_string(tokens_) +
                                        " exceeds max_tokens=" + std::to_string(max_tokens_));
    }
    const int d = model_.head_dim;
    const int64_t gt = model_.group_tokens();
    for (int kvh = 0; kvh < model_.num_kv_heads; ++kvh) {
      const float* in = keys + static_cast<size_t>(kvh) * n * d;
      // The open group's keys, for Seal (an engine re-reads them once, as core/summary.h says).
      float* open = open_group_.data() + static_cast<size_t>(kvh) * gt * d;
      // Append group by group (bit-identical to one key at a time) and seal full groups.
      for (int64_t t = tokens_; t < tokens_ + n;) {
        const int64_t group = t / gt;
        const int64_t end = std::min(tokens_ + n, (group + 1) * gt);
        const float* rows_in = in + (t - tokens_) * d;
        std::copy_n(rows_in, (end - t) * d, open + (t - group * gt) * d);
        const std::span<float> record = Record(group, kvh);
        const KeyRows rows{.data = rows_in, .count = end - t};
        if (absl::Status s = writer_.Append(record, 0, kvh, rows); !s.ok()) return s;
        if (end == (group + 1) * gt) {
          const KeyRows all{.data = open, .count = gt};
          if (absl::Status s = writer_.Seal(record, 0, kvh, all); !s.ok()) return s;
        }
        t = end;
      }
      if (model_.has_coarse_level()) {
        if (absl::Status s = AppendCoarse(in, n, kvh); !s.ok()) return s;
      }
    }
    tokens_ += n;
    return absl::OkStatus();
  }

  // The coarse level's records (as an engine writes them: one more record per coarse
  // group, from the same keys), sealed when full.
  absl::Status AppendCoarse(const float* in, int64_t n, int kvh) {
    const int d = model_.head_dim;
    const int64_t ct = int64_t{model_.coarse_blocks} * model_.block_size;
    float* open = open_coarse_.data() + static_cast<size_t>(kvh) * ct * d;
    for (int64_t t = tokens_; t < tokens_ + n;) {
      const int64_t group = t / ct;
      const int64_t end = std::min(tokens_ + n, (group + 1) * ct);
      const float* rows_in = in + (t - tokens_) * d;
      std::copy_n(rows_in, (end - t) * d, open + (t - group * ct) * d);
      const std::span<float> record = CoarseRecord(group, kvh);
      const KeyRows rows{.data = rows_in, .count = end - t};
      if (absl::Status s = writer_.Append(record, 0, kvh, rows); !s.ok()) return s;
      if (end == (group + 1) * ct) {
        const KeyRows all{.data = open, .count = ct};
        if (absl::Status s = writer_.Seal(record, 0, kvh, all); !s.ok()) return s;
      }
      t = end;
    }
    return absl::OkStatus();
  }

  // queries: [q_heads, d]; out: [q_heads, groups].
  absl::Status Scores(Method method, const float* queries, float* out) const {
    // A method whose part the records lack would score as fro (core/bounds.cc): refuse
    // it as a selection would (SelectPolicy::Validate), not return fro's scores under its name.
    SelectPolicy policy;
    policy.method = method;
    if (absl::Status s = policy.Validate(model_); !s.ok()) return s;
    const int d = model_.head_dim;
    const int64_t n = groups();
    QueryTerms terms;
    for (int h = 0; h < model_.num_q_heads; ++h) {
      const int kvh = model_.kv_head_of(h);
      terms.Prepare(phi_, 0, kvh, {queries + static_cast<size_t>(h) * d, static_cast<size_t>(d)});
      for (int64_t p = 0; p < n; ++p) {
        out[h * n + p] = Score(method, Record(p, kvh), layout_, terms);
      }
    }
    return absl::OkStatus();
  }

  // The reference step for this sequence: visit[list][group] marks.
  // feedback: [q_heads, groups] (StepInputs::feedback of this one row and layer) or null.
  absl::Status Select(const SelectPolicy& policy, const float* queries, const float* feedback,
                      uint8_t* visit, StepStats* stats) const {
    absl::StatusOr<PageSelector> selector = PageSelector::Create(model_, phi_);
    if (!selector.ok()) return selector.status();
    const int64_t n = groups();
    const int64_t blocks = BlocksFor(tokens_, model_.block_size);
    const int lists = policy.granularity == Granularity::kPerKvHead ? model_.num_kv_heads : 1;
    std::vector<int32_t> group_table(max_groups_), block_table(max_blocks_);
    std::iota(group_table.begin(), group_table.end(), 0);
    std::iota(block_table.begin(), block_table.end(), 0);
    std::vector<int32_t> visit_blocks(static_cast<size_t>(lists) * max_blocks_), count(lists);
    const StepRow row{.table_row = 0, .context_tokens = tokens_};
    StepInputs in;
    in.summary_pool = pool_.data();
    in.num_slots = max_groups_;
    in.group_table = group_table.data();
    in.block_table = block_table.data();
    in.max_seqs = 1;
    in.max_groups = max_groups_;
    in.max_blocks = max_blocks_;
    in.num_physical_blocks = max_blocks_;
    in.queries = queries;
    in.max_batch = 1;
    in.rows = {&row, 1};
    std::vector<int32_t> coarse_table(max_coarse_);
    std::iota(coarse_table.begin(), coarse_table.end(), 0);
    std::vector<float> fed;  // the step consumes it: a copy, padded to max_groups
    if (feedback != nullptr) {
      fed.assign(static_cast<size_t>(model_.num_q_heads) * max_groups_,
                 std::numeric_limits<float>::quiet_NaN());
      for (int h = 0; h < model_.num_q_heads; ++h) {
        std::copy_n(feedback + static_cast<size_t>(h) * n, n,
                    fed.data() + static_cast<size_t>(h) * max_groups_);
      }
      in.feedback = fed.data();
    }
    if (model_.has_coarse_level()) {
      in.coarse_pool = coarse_pool_.data();
      in.coarse_slots = max_coarse_;
      in.coarse_table = coarse_table.data();
      in.max_coarse_groups = max_coarse_;
    }
    if (absl::Status s = selector->Select(in, policy, {visit_blocks.data(), count.data()}, stats);
        !s.ok()) {
      return s;
    }
    std::fill_n(visit, static_cast<size_t>(lists) * n, uint8_t{0});
    for (int list = 0; list < lists; ++list) {
      for (int32_t b = 0; b < count[list]; ++b) {
        const int32_t block = visit_blocks[static_cast<size_t>(list) * max_blocks_ + b];
        if (block < 0 || block >= blocks) return absl::InternalError("visit list out of range");
        visit[list * n + block / model_.group_blocks] = 1;
      }
    }
    return absl::OkStatus();
  }

  int64_t tokens() const { return tokens_; }
  int64_t groups() const { return GroupsFor(tokens_, model_); }
  const SummaryLayout& layout() const { return layout_; }

 private:
  EvalSequence(const ModelLayout& model, int64_t max_tokens, PhiBank phi)
      : model_(model),
        layout_(SummaryLayout::For(model)),
        max_tokens_(max_tokens),
        max_blocks_(BlocksFor(max_tokens, model.block_size)),
        max_groups_(GroupsFor(max_tokens, model)),
        max_coarse_(CoarseGroupsFor(max_tokens, model)),
        phi_(std::move(phi)),
        writer_(model, phi_) {
    open_group_.assign(
        static_cast<size_t>(model.num_kv_heads) * model.group_tokens() * model.head_dim, 0.0f);
    pool_.assign(static_cast<size_t>(max_groups_) * model.num_kv_heads * layout_.record_words,
                 0.0f);
    for (int64_t p = 0; p < max_groups_; ++p) {
      for (int kvh = 0; kvh < model.num_kv_heads; ++kvh) (void)writer_.Reset(Record(p, kvh));
    }
    open_coarse_.assign(static_cast<size_t>(model.num_kv_heads) * model.coarse_blocks *
                            model.block_size * model.head_dim,
                        0.0f);
    coarse_pool_.assign(
        static_cast<size_t>(max_coarse_) * model.num_kv_heads * layout_.record_words, 0.0f);
    for (int64_t c = 0; c < max_coarse_; ++c) {
      for (int kvh = 0; kvh < model.num_kv_heads; ++kvh) (void)writer_.Reset(CoarseRecord(c, kvh));
    }
  }

  // The coarse pool's layout is the pool's; slot = coarse group.
  std::span<float> CoarseRecord(int64_t group, int kvh) {
    return {coarse_pool_.data() + (group * model_.num_kv_heads + kvh) * layout_.record_words,
            static_cast<size_t>(layout_.record_words)};
  }

  // Pool layout [slots, layers = 1, kv_heads, record_words]; slot = group.
  std::span<float> Record(int64_t group, int kvh) {
    return {pool_.data() + (group * model_.num_kv_heads + kvh) * layout_.record_words,
            static_cast<size_t>(layout_.record_words)};
  }
  std::span<const float> Record(int64_t group, int kvh) const {
    return {pool_.data() + (group * model_.num_kv_heads + kvh) * layout_.record_words,
            static_cast<size_t>(layout_.record_words)};
  }

  ModelLayout model_;
  SummaryLayout layout_;
  int64_t max_tokens_, max_blocks_, max_groups_, max_coarse_;
  PhiBank phi_;
  SummaryWriter writer_;  // borrows phi_ (declared before it)
  int64_t tokens_ = 0;
  std::vector<float> open_group_;  // [kv_heads, group_tokens, d]
  std::vector<float> pool_;
  std::vector<float> open_coarse_;  // [kv_heads, coarse_tokens, d]
  std::vector<float> coarse_pool_;  // [coarse groups, kv_heads, record_words]
};

}  // namespace eps::eval

using eps::eval::EvalSequence;
using eps::eval::Fail;
using eps::eval::ParseByName;

extern "C" {

// features: bit 0 key_sum, bit 1 principal, bit 2 quest, bit 3 quest8. coarse_blocks: the
// coarse level's blocks per coarse group, 0 for none (ModelLayout.coarse_blocks).
void* eps_eval_new(int q_heads, int kv_heads, int head_dim, int group_blocks, int sketch_dim,
                   uint64_t phi_seed, int features, int64_t max_tokens, int coarse_blocks,
                   char* err, int err_len) {
  eps::ModelLayout model;
  model.num_layers = 1;
  model.num_q_heads = q_heads;
  model.num_kv_heads = kv_heads;
  model.head_dim = head_dim;
  model.block_size = 16;
  model.group_blocks = group_blocks;
  model.coarse_blocks = coarse_blocks;
  model.sketch_dim = sketch_dim;
  model.phi_seed = phi_seed;
  model.kv_dtype = eps::DType::kFloat16;
  model.features = eps::eval::FeaturesFromMask(features);
  absl::StatusOr<std::unique_ptr<EvalSequence>> seq = EvalSequence::Create(model, max_tokens);
  if (!seq.ok()) {
    Fail(seq.status(), err, err_len);
    return nullptr;
  }
  return seq->release();
}

void eps_eval_free(void* seq) { delete static_cast<EvalSequence*>(seq); }

int eps_eval_append(void* seq, const float* keys, int64_t n, char* err, int err_len) {
  absl::Status s = static_cast<EvalSequence*>(seq)->Append(keys, n);
  return s.ok() ? 0 : Fail(s, err, err_len);
}

int64_t eps_eval_tokens(const void* seq) { return static_cast<const EvalSequence*>(seq)->tokens(); }
int64_t eps_eval_groups(const void* seq) { return static_cast<const EvalSequence*>(seq)->groups(); }

// Bytes of one summary record of head dim d, sketch dim m and `features`.
int eps_eval_record_bytes(int head_dim, int sketch_dim, int features) {
  eps::ModelLayout model;
  model.head_dim = head_dim;
  model.sketch_dim = sketch_dim;
  model.features = eps::eval::FeaturesFromMask(features);
  return static_cast<int>(eps::SummaryLayout::For(model).record_bytes());
}

// out[i] = Quest8ScaleFor(amax[i]) for i < n; every amax[i] finite and > 0 (the writer
// stores no scale for all-zero keys).
int eps_eval_quest8_scales(const float* amax, int64_t n, float* out, char* err, int err_len) {
  for (int64_t i = 0; i < n; ++i) {
    if (!(amax[i] > 0.0f && std::isfinite(amax[i]))) {
      return Fail(absl::InvalidArgumentError(
                      absl::StrCat("amax[", i, "]=", amax[i], " is not a finite number > 0")),
                  err, err_len);
    }
    out[i] = eps::Quest8ScaleFor(amax[i]);
  }
  return 0;
}

int eps_eval_scores(const void* seq, const char* method, const float* queries, float* out,
                    char* err, int err_len) {
  eps::Method m;
  if (!eps::ParseMethod(method, &m)) {
    return Fail(absl::InvalidArgumentError(std::string("unknown method ") + method), err, err_len);
  }
  absl::Status s = static_cast<const EvalSequence*>(seq)->Scores(m, queries, out);
  return s.ok() ? 0 : Fail(s, err, err_len);
}

// Threshold selection (core/select.h) from given scores [q_heads, n] for each
// top_pages[i]: out [n_top, lists, n] marks, lists = kv_heads if per_kv_head else 1.
int eps_eval_mark(int64_t n, int q_heads, int kv_heads, const float* scores, int first_n,
                  int last_n, const int* top_pages, int n_top, float alpha, int per_kv_head,
                  uint8_t* out, char* err, int err_len) {
  eps::SelectPolicy policy;
  policy.first_n = first_n;
  policy.last_n = last_n;
  policy.alpha = alpha;
  if (n < 1 || q_heads < 1 || kv_heads < 1 || q_heads % kv_heads != 0) {
    return Fail(absl::InvalidArgumentError("bad shape for eps_eval_mark"), err, err_len);
  }
  const int lists = per_kv_head ? kv_heads : 1;
  std::vector<uint8_t> forced(n, 0);
  eps::MarkForced(policy, forced);
  for (int i = 0; i < n_top; ++i) {
    policy.top_pages = top_pages[i];
    if (absl::Status s = policy.Validate(eps::ModelLayout{}); !s.ok()) return Fail(s, err, err_len);
    eps::eval::MarkLists(
        n, q_heads, kv_heads, per_kv_head, forced, out + static_cast<size_t>(i) * lists * n,
        [&](int h, std::span<uint8_t> visit) {
          eps::MarkByThreshold({scores + static_cast<size_t>(h) * n, static_cast<size_t>(n)},
                               forced, top_pages[i], alpha, visit);
        });
  }
  return 0;
}

// Mass budget from scores [q_heads, n] for each target of `targets`: out
// [n_targets, lists, n]. Head scope (core MarkByMass): each head's marks OR-ed
// into its list; list scope (list_scope != 0, core MarkByMassList): one walk
// over each list's heads.
int eps_eval_mark_mass(int64_t n, int q_heads, int kv_heads, const float* scores, int first_n,
                       int last_n, const float* targets, int n_targets, float temperature,
                       int head_dim, int min_pages, int max_pages, int per_kv_head, int list_scope,
                       uint8_t* out, char* err, int err_len) {
  eps::SelectPolicy policy;
  policy.first_n = first_n;
  policy.last_n = last_n;
  policy.budget = eps::Budget::kMass;
  policy.mass_temperature = temperature;
  policy.min_pages = min_pages;
  policy.max_pages = max_pages;
  if (n < 1 || q_heads < 1 || kv_heads < 1 || q_heads % kv_heads != 0 || head_dim < 1) {
    return Fail(absl::InvalidArgumentError("bad shape for eps_eval_mark_mass"), err, err_len);
  }
  const int lists = per_kv_head ? kv_heads : 1;
  const int heads_per_list = q_heads / lists;
  std::vector<uint8_t> forced(n, 0);
  eps::MarkForced(policy, forced);
  auto head = [&](int h) {
    return std::span<const float>(scores + static_cast<size_t>(h) * n, static_cast<size_t>(n));
  };
  for (int i = 0; i < n_targets; ++i) {
    policy.mass_target = targets[i];
    if (absl::Status s = policy.Validate(eps::ModelLayout{}); !s.ok()) return Fail(s, err, err_len);
    uint8_t* out_i = out + static_cast<size_t>(i) * lists * n;
    if (list_scope == 0) {
      eps::eval::MarkLists(n, q_heads, kv_heads, per_kv_head, forced, out_i,
                           [&](int h, std::span<uint8_t> visit) {
                             eps::MarkByMass(head(h), forced, targets[i], temperature, head_dim,
                                             min_pages, max_pages, visit);
                           });
      continue;
    }
    for (int list = 0; list < lists; ++list) {
      std::vector<std::span<const float>> heads;
      for (int h = list * heads_per_list; h < (list + 1) * heads_per_list; ++h) {
        heads.push_back(head(h));
      }
      const std::span<uint8_t> visit(out_i + static_cast<size_t>(list) * n, n);
      std::copy(forced.begin(), forced.end(), visit.begin());
      eps::MarkByMassList(heads, forced, targets[i], temperature, head_dim, min_pages, max_pages,
                          visit);
    }
  }
  return 0;
}

// The budget fields of SelectPolicy (core/select.h), by core's names: budget one of
// BudgetName's ("threshold", "fixed", "top_p", "mass"), mass_scope "head" or "list".
struct EvalBudget {
  const char* budget;
  float top_p;
  float mass_target;
  float mass_temperature;
  int min_pages;
  int max_pages;
  const char* mass_scope;
};

// PageSelector::Select on this sequence. stats: 7 int64 (StepStats field order).
// budget: null for the threshold budget (top_pages, alpha), else its fields.
int eps_eval_select(const void* seq, const char* method, const float* queries, int top_pages,
                    float alpha, int strict, int per_kv_head, int first_n, int last_n,
                    float coarse_candidates, const EvalBudget* budget, const float* feedback,
                    uint8_t* visit, int64_t* stats, char* err, int err_len) {
  eps::SelectPolicy policy;
  if (budget != nullptr) {
    using eps::Budget;
    using eps::MassScope;
    if (!ParseByName(budget->budget,
                     {Budget::kThreshold, Budget::kFixed, Budget::kTopP, Budget::kMass},
                     eps::BudgetName, &policy.budget)) {
      return Fail(absl::InvalidArgumentError(std::string("unknown budget ") + budget->budget), err,
                  err_len);
    }
    if (!ParseByName(budget->mass_scope, {MassScope::kHead, MassScope::kList}, eps::MassScopeName,
                     &policy.mass_scope)) {
      return Fail(
          absl::InvalidArgumentError(std::string("unknown mass_scope ") + budget->mass_scope), err,
          err_len);
    }
    policy.top_p = budget->top_p;
    policy.mass_target = budget->mass_target;
    policy.mass_temperature = budget->mass_temperature;
    policy.min_pages = budget->min_pages;
    policy.max_pages = budget->max_pages;
  }
  if (!eps::ParseMethod(method, &policy.method)) {
    return Fail(absl::InvalidArgumentError(std::string("unknown method ") + method), err, err_len);
  }
  policy.top_pages = top_pages;
  policy.alpha = alpha;
  policy.strict = strict != 0;
  policy.first_n = first_n;
  policy.last_n = last_n;
  policy.coarse_candidates = coarse_candidates;
  policy.granularity = per_kv_head ? eps::Granularity::kPerKvHead : eps::Granularity::kUnion;
  eps::StepStats st;
  absl::Status s =
      static_cast<const EvalSequence*>(seq)->Select(policy, queries, feedback, visit, &st);
  if (!s.ok()) return Fail(s, err, err_len);
  const int64_t values[7] = {st.groups_total,      st.groups_visited, st.blocks_total,
                             st.blocks_visited,    st.kv_bytes_dense, st.kv_bytes_read_est,
                             st.summary_bytes_read};
  std::copy_n(values, 7, stats);
  return 0;
}

}  // extern "C"
