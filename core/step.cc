#include "core/step.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/bounds.h"
#include "core/saturating.h"
#include "core/status.h"
#include "core/visit_list.h"

namespace eps {
namespace {
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
}  // namespace

void StepStats::Add(const StepStats& o) {
  groups_total += o.groups_total;
  groups_visited += o.groups_visited;
  blocks_total += o.blocks_total;
  blocks_visited += o.blocks_visited;
  kv_bytes_dense = SaturatingMulAdd(kv_bytes_dense, {o.kv_bytes_dense});
  kv_bytes_read_est = SaturatingMulAdd(kv_bytes_read_est, {o.kv_bytes_read_est});
  summary_bytes_read = SaturatingMulAdd(summary_bytes_read, {o.summary_bytes_read});
}

absl::Status CheckRowFits(const ModelLayout& model, const StepInputs& in, size_t i) {
  const StepRow& row = in.rows[i];
  if (row.table_row < 0 || row.table_row >= in.max_seqs) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows[", i, "].table_row=", row.table_row, " not in [0, ", in.max_seqs, ")"));
  }
  const int64_t blocks = BlocksFor(row.context_tokens, model.block_size);
  const int64_t groups = GroupsFor(row.context_tokens, model);
  // A visit list's count is an int32 (visit_count), whatever the table's row holds.
  const int64_t max_blocks = std::min<int64_t>(in.max_blocks, std::numeric_limits<int32_t>::max());
  if (row.context_tokens < 1 || blocks > max_blocks || groups > in.max_groups) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rows[", i, "].context_tokens=", row.context_tokens, " not in [1, ",
        std::min(max_blocks * model.block_size, in.max_groups * model.group_tokens()), "]"));
  }
  if (model.has_coarse_level() && in.coarse_table != nullptr &&
      CoarseGroupsFor(row.context_tokens, model) > in.max_coarse_groups) {
    return absl::InvalidArgumentError(
        absl::StrCat("rows[", i, "].context_tokens=", row.context_tokens, " needs ",
                     CoarseGroupsFor(row.context_tokens, model),
                     " coarse groups, max_coarse_groups=", in.max_coarse_groups));
  }
  return absl::OkStatus();
}

absl::Status CheckCoarseInputs(const ModelLayout& model, const SelectPolicy& policy,
                               const StepInputs& in) {
  if (policy.UsesCoarseLevel(model) && (in.coarse_pool == nullptr || in.coarse_table == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the layout has a coarse level (coarse_blocks=", model.coarse_blocks,
                     ") but the step has no coarse_pool or coarse_table"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PageSelector> PageSelector::Create(const ModelLayout& model, const PhiBank& phi) {
  if (absl::Status s = model.Validate(); !s.ok()) return s;
  if (absl::Status s = PhiCovers(phi, model); !s.ok()) return s;
  return PageSelector(model, phi);
}

absl::Status PageSelector::ValidateInputs(const StepInputs& in, const SelectPolicy& policy) const {
  if (absl::Status s = policy.Validate(model_); !s.ok()) return s;
  if (in.rows.empty()) return absl::OkStatus();
  if (in.summary_pool == nullptr || in.group_table == nullptr || in.block_table == nullptr ||
      in.queries == nullptr) {
    return absl::InvalidArgumentError("a step input buffer is missing");
  }
  if (static_cast<int64_t>(in.rows.size()) > in.max_batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch of ", in.rows.size(), " rows exceeds max_batch=", in.max_batch));
  }
  if (in.query_dtype != DType::kFloat32 && in.query_dtype != DType::kFloat16 &&
      in.query_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("query dtype ", DTypeName(in.query_dtype), " is not a float type"));
  }
  const bool coarse = policy.UsesCoarseLevel(model_);
  RETURN_IF_ERROR(CheckCoarseInputs(model_, policy, in));
  const int d = model_.head_dim;
  for (size_t i = 0; i < in.rows.size(); ++i) {
    const StepRow& row = in.rows[i];
    if (absl::Status s = CheckRowFits(model_, in, i); !s.ok()) return s;
    const int64_t blocks = BlocksFor(row.context_tokens, model_.block_size);
    const int64_t groups = GroupsFor(row.context_tokens, model_);
    const int32_t* groups_row = in.group_table + row.table_row * in.max_groups;
    for (int64_t p = 0; p < groups; ++p) {
      if (groups_row[p] < 0 || groups_row[p] >= in.num_slots) {
        return absl::InvalidArgumentError(absl::StrCat("group_table[", row.table_row, "][", p,
                                                       "]=", groups_row[p], " not in [0, ",
                                                       in.num_slots, ")"));
      }
    }
    if (coarse) {
      const int32_t* coarse_row = in.coarse_table + row.table_row * in.max_coarse_groups;
      for (int64_t c = 0; c < CoarseGroupsFor(row.context_tokens, model_); ++c) {
        if (coarse_row[c] < 0 || coarse_row[c] >= in.coarse_slots) {
          return absl::InvalidArgumentError(absl::StrCat("coarse_table[", row.table_row, "][", c,
                                                         "]=", coarse_row[c], " not in [0, ",
                                                         in.coarse_slots, ")"));
        }
      }
    }
    const int32_t* blocks_row = in.block_table + row.table_row * in.max_blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      if (blocks_row[b] < 0 ||
          (in.num_physical_blocks >= 0 && blocks_row[b] >= in.num_physical_blocks)) {
        return absl::InvalidArgumentError(absl::StrCat("block_table[", row.table_row, "][", b,
                                                       "]=", blocks_row[b], " not in [0, ",
                                                       in.num_physical_blocks, ")"));
      }
    }
    // Only the queries that are scored are read (method off reads none, as the GPU).
    for (int layer = 0; layer < model_.num_layers && policy.method != Method::kOff; ++layer) {
      for (int h = 0; h < model_.num_q_heads; ++h) {
        if (!policy.HeadIsScored(model_, layer, h)) continue;
        const int64_t base =
            ((static_cast<int64_t>(layer) * in.max_batch + i) * model_.num_q_heads + h) * d;
        double norm2 = 0.0;
        for (int k = 0; k < d; ++k) {
          const float x = LoadAsFloat(in.queries, in.query_dtype, base + k);
          if (!std::isfinite(x)) {
            return absl::InvalidArgumentError(absl::StrCat("query[layer ", layer, "][row ", i,
                                                           "][head ", h, "][", k, "] is ", x));
          }
          norm2 += double{x} * x;
        }
        if (norm2 >= double{kMaxQueryNorm2}) {  // core/bounds.h: the GPU's rule too
          return absl::InvalidArgumentError(absl::StrCat("query[layer ", layer, "][row ", i,
                                                         "][head ", h, "] has |q|^2 = ", norm2,
                                                         ", beyond the float range of the scores"));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status PageSelector::Select(const StepInputs& in, const SelectPolicy& policy,
                                  const StepOutputs& out, StepStats* stats,
                                  const StopCheck& stop) const {
  if (absl::Status s = ValidateInputs(in, policy); !s.ok()) return s;
  if (!in.rows.empty() && (out.visit_blocks == nullptr || out.visit_count == nullptr)) {
    return absl::InvalidArgumentError("an output buffer is missing");
  }
  const int d = model_.head_dim;
  const int kv_heads = model_.num_kv_heads;
  const int ratio = model_.gqa_ratio();
  const bool per_head = policy.granularity == Granularity::kPerKvHead;
  const int lists = per_head ? kv_heads : 1;
  const int64_t kv_token_bytes = int64_t{2} * d * DTypeSize(model_.kv_dtype);
  StepStats total;

  // Visit lists go to scratch first and reach the outputs only when the whole
  // step succeeded: a bad summary found mid-step leaves the outputs untouched.
  // Scratch holds the batch's lists only, indexed [layer][row][list], each as long as its
  // row's blocks (not max_blocks: a table sized for long contexts costs short rows nothing).
  const int64_t batch = static_cast<int64_t>(in.rows.size());
  const int64_t list_count = static_cast<int64_t>(model_.num_layers) * batch * lists;
  std::vector<int64_t> row_offset(batch + 1, 0);  // blocks of the rows before row i
  for (int64_t i = 0; i < batch; ++i) {
    row_offset[i + 1] = row_offset[i] + BlocksFor(in.rows[i].context_tokens, model_.block_size);
  }
  const auto scratch_list = [&](int64_t layer, int64_t i, int list) {
    return (layer * lists + list) * row_offset[batch] + row_offset[i];
  };
  std::vector<int32_t> scratch_blocks(static_cast<size_t>(model_.num_layers) * lists *
                                      row_offset[batch]);
  std::vector<int32_t> scratch_count(list_count, 0);

  QueryTerms terms;
  std::vector<float> query(d);
  std::vector<float> scores;
  std::vector<MaxScoreBracket> brackets;
  std::vector<std::vector<float>> head_scores(model_.num_q_heads);
  const bool coarse = policy.UsesCoarseLevel(model_);
  const int ratio_c = model_.coarse_ratio();
  const int coarse_candidates = coarse ? policy.CoarseCandidates(model_) : 0;

  // One head's scores of the records `slots` names in `pool` (the fine or the coarse
  // level), or only of the groups `allowed` marks (−∞ for the others, unread).
  auto score_head = [&](const char* table, const float* pool, int64_t num_slots,
                        const int32_t* slots, int32_t table_row, int64_t count, int layer, int kvh,
                        const std::vector<uint8_t>* allowed, bool bracket) -> absl::Status {
    scores.assign(count, -kInf);
    brackets.resize(count);
    for (int64_t p = 0; p < count; ++p) {
      if (allowed != nullptr && !(*allowed)[p]) continue;
      // The tables live in memory the engine may write during the step:
      // read each slot once and re-check it before it becomes an index.
      const int32_t slot = slots[p];
      if (slot < 0 || slot >= num_slots) {
        return absl::InvalidArgumentError(
            absl::StrCat(table, "[", table_row, "][", p, "]=", slot, " changed during the step"));
      }
      const int64_t record_index =
          (static_cast<int64_t>(slot) * model_.num_layers + layer) * kv_heads + kvh;
      const std::span<const float> record(pool + record_index * layout_.record_words,
                                          layout_.record_words);
      bool bad_score;
      if (bracket) {
        brackets[p] = BracketMaxScore(record, layout_, terms);
        bad_score = std::isnan(brackets[p].lower) || std::isnan(brackets[p].upper);
      } else {
        scores[p] = Score(policy.method, record, layout_, terms);
        // −∞ is an empty group's score only: a record with keys scores it from an infinite
        // quest half (corruption), and would be ranked as if it held none.
        bad_score = std::isnan(scores[p]) || scores[p] == kInf ||
                    (scores[p] == -kInf && record[layout_.count] > 0.0f);
      }
      const float* stat = record.data() + layout_.fro2;
      if (bad_score || !std::isfinite(stat[0]) || !std::isfinite(stat[1]) ||
          !std::isfinite(stat[2])) {
        // Blame the summary only if it holds a NaN or Inf word (any part, the principal
        // pair's and the quest halves included); else the query's terms and this
        // group's keys overflow together.
        const bool sums_finite = RecordIsFinite(record, layout_);
        return absl::InvalidArgumentError(absl::StrCat(
            pool == in.coarse_pool ? "coarse summary" : "summary", " of slot ", slot, " (layer ",
            layer, ", kv_head ", kvh, ") gives a non-finite score: ",
            sums_finite ? absl::StrCat("its keys (largest norm ", stat[1],
                                       ") and the step's queries overflow the float range "
                                       "together; scale the queries or keys down")
                        : "the summary holds NaN or Inf"));
      }
    }
    return absl::OkStatus();
  };
  auto load_query = [&](int layer, int64_t i, int h) {
    const int64_t qbase =
        ((static_cast<int64_t>(layer) * in.max_batch + i) * model_.num_q_heads + h) * d;
    for (int k = 0; k < d; ++k) query[k] = LoadAsFloat(in.queries, in.query_dtype, qbase + k);
  };

  for (size_t i = 0; i < in.rows.size(); ++i) {
    const StepRow& row = in.rows[i];
    const int64_t n = GroupsFor(row.context_tokens, model_);
    const int64_t nb = BlocksFor(row.context_tokens, model_.block_size);
    const int64_t nc = coarse ? CoarseGroupsFor(row.context_tokens, model_) : 0;
    const int32_t* slots = in.group_table + row.table_row * in.max_groups;
    const int32_t* coarse_slots =
        coarse ? in.coarse_table + row.table_row * in.max_coarse_groups : nullptr;
    const std::span<const int32_t> block_row(in.block_table + row.table_row * in.max_blocks, nb);
    std::vector<uint8_t> forced(n, 0);
    MarkForced(policy, forced);
    std::vector<uint8_t> coarse_forced(nc, 0);
    if (coarse) MarkCoarseForced(forced, ratio_c, coarse_forced);
    std::vector<std::vector<uint8_t>> visit(lists);
    // With the coarse level: each list's candidate coarse groups, and the groups they hold.
    std::vector<std::vector<uint8_t>> candidates(lists);
    std::vector<std::vector<uint8_t>> allowed(lists);
    std::vector<std::vector<uint8_t>> fed(lists);  // groups with feedback for a head of the list

    for (int layer = 0; layer < model_.num_layers; ++layer) {
      if (stop) RETURN_IF_ERROR(stop());
      for (auto& v : visit) {
        if (policy.method == Method::kOff) {
          v.assign(n, uint8_t{1});
        } else {
          v = forced;
        }
      }
      int64_t summary_records = 0;
      for (auto& f : fed) f.assign(n, 0);
      if (coarse) {
        // Coarse level: every scored head's best coarse groups join its list's candidates.
        for (auto& c : candidates) c = coarse_forced;
        for (int kvh = 0; kvh < kv_heads; ++kvh) {
          bool kv_head_scored = false;
          for (int h = kvh * ratio; h < (kvh + 1) * ratio; ++h) {
            if (!policy.HeadIsScored(model_, layer, h)) continue;
            kv_head_scored = true;
            load_query(layer, static_cast<int64_t>(i), h);
            terms.Prepare(*phi_, layer, kvh, query);
            RETURN_IF_ERROR(score_head("coarse_table", in.coarse_pool, in.coarse_slots,
                                       coarse_slots, row.table_row, nc, layer, kvh, nullptr,
                                       false));
            MarkByThreshold(scores, coarse_forced, coarse_candidates, 1.0f,
                            candidates[per_head ? kvh : 0]);
          }
          summary_records += kv_head_scored ? nc : 0;
        }
        for (int list = 0; list < lists; ++list) {
          allowed[list].assign(n, 0);
          for (int64_t p = 0; p < n; ++p) allowed[list][p] = candidates[list][p / ratio_c];
        }
      }
      // The heads' scores of each list, for the budgets that mark a list at once.
      std::vector<std::vector<std::span<const float>>> listed(lists);
      for (int kvh = 0; kvh < kv_heads && policy.method != Method::kOff; ++kvh) {
        const int list_of_head = per_head ? kvh : 0;
        std::vector<uint8_t>& target = visit[list_of_head];
        const std::vector<uint8_t>* only = coarse ? &allowed[list_of_head] : nullptr;
        bool kv_head_scored = false;
        for (int h = kvh * ratio; h < (kvh + 1) * ratio; ++h) {
          if (!policy.HeadIsScored(model_, layer, h)) continue;
          kv_head_scored = true;
          load_query(layer, static_cast<int64_t>(i), h);
          terms.Prepare(*phi_, layer, kvh, query);
          RETURN_IF_ERROR(score_head("group_table", in.summary_pool, in.num_slots, slots,
                                     row.table_row, n, layer, kvh, only, policy.strict));
          if (in.feedback != nullptr && !policy.strict) {
            const float* entry =
                in.feedback +
                ((static_cast<int64_t>(layer) * in.max_seqs + row.table_row) * model_.num_q_heads +
                 h) *
                    in.max_groups;
            ApplyFeedback({entry, static_cast<size_t>(n)}, d, scores);
            for (int64_t p = 0; p < n; ++p) fed[list_of_head][p] |= IsFeedback(entry[p]);
          }
          switch (policy.budget) {
            case Budget::kThreshold:
              if (policy.strict) {
                MarkStrict(brackets, policy.top_pages, target);
              } else {
                MarkByThreshold(scores, forced, policy.top_pages, policy.alpha, target);
              }
              break;
            case Budget::kTopP:
              MarkTopP(scores, forced, policy.top_p, d, target);
              break;
            case Budget::kMass:
              if (policy.mass_scope == MassScope::kHead) {
                const MassSetting mass = policy.MassFor(layer);
                MarkByMass(scores, forced, mass.target, mass.temperature, d, mass.min_pages,
                           mass.max_pages, target);
                break;
              }
              [[fallthrough]];  // list scope: marked per list below, as the fixed budget
            case Budget::kFixed:
              head_scores[h] = scores;
              listed[list_of_head].push_back(head_scores[h]);
              break;
          }
        }
        if (kv_head_scored) {
          summary_records +=
              only == nullptr ? n : std::count(only->begin(), only->end(), uint8_t{1});
        }
      }
      if (policy.method != Method::kOff) {
        for (int list = 0; list < lists; ++list) {
          // Lists without a scored head (heads=retrieval) keep sinks + recent only.
          if (listed[list].empty()) continue;
          if (policy.budget == Budget::kFixed) {
            MarkFixedBudget(listed[list], forced, policy.top_pages, visit[list]);
          } else if (policy.budget == Budget::kMass) {
            const MassSetting mass = policy.MassFor(layer);
            MarkByMassList(listed[list], forced, mass.target, mass.temperature, d, mass.min_pages,
                           mass.max_pages, visit[list]);
          }
        }
      }
      if (coarse) {
        // Groups outside the candidates were never scored: a rule that marked them
        // (fewer candidates than the budget) gives them up; forced groups are candidates,
        // and groups with feedback compete whether or not they are.
        for (int list = 0; list < lists; ++list) {
          for (int64_t p = 0; p < n; ++p) visit[list][p] &= allowed[list][p] | fed[list][p];
        }
      }
      for (int list = 0; list < lists; ++list) {
        const int64_t scratch_index = (static_cast<int64_t>(layer) * batch + i) * lists + list;
        const std::span<int32_t> blocks_out(scratch_blocks.data() + scratch_list(layer, i, list),
                                            nb);
        const int32_t count =
            WriteVisitList(visit[list], block_row, nb, model_.group_blocks, blocks_out);
        scratch_count[scratch_index] = count;
        int64_t visited_groups = 0;
        for (uint8_t v : visit[list]) visited_groups += v;
        const int heads_read = per_head ? 1 : kv_heads;
        total.groups_total += n;
        total.groups_visited += visited_groups;
        total.blocks_total += nb;
        total.blocks_visited += count;
        total.kv_bytes_dense = SaturatingMulAdd(total.kv_bytes_dense,
                                                {row.context_tokens, heads_read, kv_token_bytes});
        total.kv_bytes_read_est = SaturatingMulAdd(
            total.kv_bytes_read_est, {VisitedTokens(count, row.context_tokens, model_.block_size),
                                      heads_read, kv_token_bytes});
      }
      total.summary_bytes_read =
          SaturatingMulAdd(total.summary_bytes_read, {summary_records, layout_.record_bytes()});
    }
  }
  for (int layer = 0; layer < model_.num_layers; ++layer) {
    for (int64_t i = 0; i < batch; ++i) {
      for (int list = 0; list < lists; ++list) {
        const int64_t from = (static_cast<int64_t>(layer) * batch + i) * lists + list;
        const int64_t to = (static_cast<int64_t>(layer) * in.max_batch + i) * lists + list;
        std::copy_n(scratch_blocks.data() + scratch_list(layer, i, list), scratch_count[from],
                    out.visit_blocks + to * in.max_blocks);
        out.visit_count[to] = scratch_count[from];
      }
    }
  }
  if (in.feedback != nullptr) {
    // Consumed: the next step sees only what the attention after this one writes. A strict
    // step, which reads none of it, consumes it too, so that an entry never outlives the
    // step after the attention that wrote it, whatever the next step's policy.
    for (int layer = 0; layer < model_.num_layers; ++layer) {
      for (const StepRow& row : in.rows) {
        float* entry = in.feedback + (static_cast<int64_t>(layer) * in.max_seqs + row.table_row) *
                                         model_.num_q_heads * in.max_groups;
        for (int h = 0; h < model_.num_q_heads; ++h, entry += in.max_groups) {
          std::fill_n(entry, GroupsFor(row.context_tokens, model_), kNaN);
        }
      }
    }
  }
  if (stats != nullptr) *stats = total;
  return absl::OkStatus();
}

}  // namespace eps
