#include "service/convert.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "core/visit_list.h"

namespace eps::service {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::StatusOr<DType> FromProto(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FLOAT32:
      return DType::kFloat32;
    case v1::DTYPE_FLOAT16:
      return DType::kFloat16;
    case v1::DTYPE_BFLOAT16:
      return DType::kBFloat16;
    case v1::DTYPE_INT32:
      return DType::kInt32;
    case v1::DTYPE_INT8:
      return DType::kInt8;
    case v1::DTYPE_UINT64:
      return DType::kUInt64;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", ProtoDTypeName(dtype), " has no core equivalent"));
  }
}

v1::DType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return v1::DTYPE_FLOAT32;
    case DType::kFloat16:
      return v1::DTYPE_FLOAT16;
    case DType::kBFloat16:
      return v1::DTYPE_BFLOAT16;
    case DType::kInt32:
      return v1::DTYPE_INT32;
    case DType::kInt8:
      return v1::DTYPE_INT8;
    case DType::kUInt64:
      return v1::DTYPE_UINT64;
  }
  return v1::DTYPE_UNSPECIFIED;
}

const char* ProtoDTypeName(v1::DType dtype) {
  const std::string& name = v1::DType_Name(dtype);
  return name.empty() ? "DTYPE_<unknown>" : name.c_str();
}

absl::StatusOr<ModelLayout> LayoutFromProto(const v1::ModelLayout& p, int default_group_blocks,
                                            int default_sketch_dim) {
  ModelLayout m;
  auto narrow = [](const char* field, uint64_t value, int* out) -> absl::Status {
    if (value > (1u << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout.", field, "=", value, " is too large"));
    }
    *out = static_cast<int>(value);
    return absl::OkStatus();
  };
  if (absl::Status s = narrow("num_layers", p.num_layers(), &m.num_layers); !s.ok()) return s;
  if (absl::Status s = narrow("num_q_heads", p.num_q_heads(), &m.num_q_heads); !s.ok()) return s;
  if (absl::Status s = narrow("num_kv_heads", p.num_kv_heads(), &m.num_kv_heads); !s.ok()) return s;
  if (absl::Status s = narrow("head_dim", p.head_dim(), &m.head_dim); !s.ok()) return s;
  if (absl::Status s = narrow("block_size", p.block_size(), &m.block_size); !s.ok()) return s;
  if (absl::Status s = narrow("group_blocks", p.group_blocks(), &m.group_blocks); !s.ok()) return s;
  if (absl::Status s = narrow("sketch_dim", p.sketch_dim(), &m.sketch_dim); !s.ok()) return s;
  if (m.group_blocks == 0) m.group_blocks = default_group_blocks;
  if (m.sketch_dim == 0) m.sketch_dim = default_sketch_dim;
  // 0 = no coarse level: unlike group_blocks there is no server default, the engine
  // decides whether it writes the coarse records.
  if (absl::Status s = narrow("coarse_blocks", p.coarse_blocks(), &m.coarse_blocks); !s.ok()) {
    return s;
  }
  m.phi_seed = p.phi_seed();
  if (p.kv_dtype() == v1::DTYPE_UNSPECIFIED) {
    m.kv_dtype = DType::kFloat16;
  } else {
    absl::StatusOr<DType> kv = FromProto(p.kv_dtype());
    if (!kv.ok() || (*kv != DType::kFloat16 && *kv != DType::kBFloat16 && *kv != DType::kFloat32 &&
                     *kv != DType::kInt8)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout.kv_dtype=", ProtoDTypeName(p.kv_dtype()), " is not a KV type"));
    }
    m.kv_dtype = *kv;
  }
  m.features = {.key_sum = p.features().key_sum(),
                .principal = p.features().principal(),
                .quest = p.features().quest(),
                .quest8 = p.features().quest8()};
  if (absl::Status s = m.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("layout.", s.message()));
  }
  // The record layout the engine writes must be the one epsd reads (core/layout.h).
  const uint32_t revision = p.summary_layout() == 0 ? 1 : p.summary_layout();
  if (revision > static_cast<uint32_t>(kSummaryLayoutRevision)) {
    return absl::InvalidArgumentError(absl::StrCat("layout.summary_layout=", revision,
                                                   " is newer than this epsd's ",
                                                   kSummaryLayoutRevision, ": upgrade epsd"));
  }
  if (m.features.quest8 && revision < 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout.features.quest8 needs layout.summary_layout >= 3 (the revision that added the "
        "part), got ",
        revision));
  }
  if (revision == 1 && LayoutDiffersFromRevision1(m)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layout.summary_layout=", revision, ": the engine writes the quest part at word ",
        Revision1QuestMin(m), " of each record, and this epsd reads it at word ",
        SummaryLayout::For(m).quest_min, " (summary layout revision 2 and later",
        "): upgrade the engine's client library (docs/summaries.md)"));
  }
  return m;
}

namespace {

// A count field of SelectOptions or MassSetting (first_n, last_n, top_pages, min_pages,
// max_pages) as SelectPolicy's int holds it: a value above 2^30 acts as 2^30, as many
// groups as there are in a row of up to 2^30 groups (docs/api.md).
constexpr uint32_t kCountCap = uint32_t{1} << 30;
int CappedCount(uint32_t sent) { return static_cast<int>(std::min(sent, kCountCap)); }

}  // namespace

absl::StatusOr<SelectPolicy> MergeOptions(const SelectPolicy& base, const v1::SelectOptions& o) {
  SelectPolicy p = base;
  // The relations of the count fields, on the values as sent where both came in this message,
  // before CappedCount (capped first, min_pages=2^31+5 and max_pages=2^31 both read 2^30 and
  // passed). One left unset takes base's value, whose relation SelectPolicy::Validate checks
  // after the cap: a base value of 2^30 may stand for any larger one sent before.
  if (o.has_min_pages() && o.has_max_pages()) {
    RETURN_IF_ERROR(CheckPageBounds(o.min_pages(), o.max_pages(), ""));
  }
  for (int i = 0; i < o.mass_layers_size(); ++i) {
    RETURN_IF_ERROR(CheckPageBounds(o.mass_layers(i).min_pages(), o.mass_layers(i).max_pages(),
                                    absl::StrCat("mass_layers[", i, "].")));
  }
  switch (o.method()) {
    case v1::METHOD_UNSPECIFIED:
      break;
    case v1::METHOD_OFF:
      p.method = Method::kOff;
      break;
    case v1::METHOD_JL:
      p.method = Method::kJl;
      break;
    case v1::METHOD_1PC:
      p.method = Method::kOnePc;
      break;
    case v1::METHOD_FRO:
      p.method = Method::kFro;
      break;
    case v1::METHOD_QUEST:
      p.method = Method::kQuest;
      break;
    case v1::METHOD_QUEST_CLT:
      p.method = Method::kQuestClt;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("options.method=", o.method(), " is unknown"));
  }
  if (o.has_alpha()) p.alpha = o.alpha();
  if (o.has_first_n()) p.first_n = CappedCount(o.first_n());
  if (o.has_last_n()) p.last_n = CappedCount(o.last_n());
  if (o.has_top_pages()) p.top_pages = CappedCount(o.top_pages());
  if (o.has_strict()) p.strict = o.strict();
  if (o.heads() == v1::HEAD_MODE_ALL) p.heads = HeadMode::kAll;
  if (o.heads() == v1::HEAD_MODE_RETRIEVAL) p.heads = HeadMode::kRetrieval;
  if (o.heads() > v1::HEAD_MODE_RETRIEVAL || o.heads() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("options.heads=", o.heads(), " is unknown"));
  }
  if (!o.retrieval_heads().empty()) {
    p.retrieval_heads.assign(o.retrieval_heads().begin(), o.retrieval_heads().end());
  }
  switch (o.budget()) {
    case v1::BUDGET_UNSPECIFIED:
      break;
    case v1::BUDGET_THRESHOLD:
      p.budget = Budget::kThreshold;
      break;
    case v1::BUDGET_FIXED:
      p.budget = Budget::kFixed;
      break;
    case v1::BUDGET_TOP_P:
      p.budget = Budget::kTopP;
      break;
    case v1::BUDGET_MASS:
      p.budget = Budget::kMass;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("options.budget=", o.budget(), " is unknown"));
  }
  if (o.has_top_p()) p.top_p = o.top_p();
  if (o.has_mass_target()) p.mass_target = o.mass_target();
  if (o.has_mass_temperature()) p.mass_temperature = o.mass_temperature();
  if (o.has_min_pages()) p.min_pages = CappedCount(o.min_pages());
  if (o.has_max_pages()) p.max_pages = CappedCount(o.max_pages());
  if (o.has_coarse_candidates()) p.coarse_candidates = o.coarse_candidates();
  // A repeated field has no presence: empty keeps the base's list (the session's, in a
  // step), so a step can leave a session's per-layer settings alone; a non-empty list
  // replaces it whole. The count and ranges are SelectPolicy::Validate's to check.
  if (!o.mass_layers().empty()) {
    p.mass_layers.clear();
    p.mass_layers.reserve(static_cast<size_t>(o.mass_layers_size()));
    for (const v1::MassSetting& m : o.mass_layers()) {
      p.mass_layers.push_back(
          {m.target(), m.temperature(), CappedCount(m.min_pages()), CappedCount(m.max_pages())});
    }
  }
  switch (o.mass_scope()) {
    case v1::MASS_SCOPE_UNSPECIFIED:
      break;
    case v1::MASS_SCOPE_HEAD:
      p.mass_scope = MassScope::kHead;
      break;
    case v1::MASS_SCOPE_LIST:
      p.mass_scope = MassScope::kList;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("options.mass_scope=", o.mass_scope(), " is unknown"));
  }
  if (o.granularity() == v1::GRANULARITY_UNION) p.granularity = Granularity::kUnion;
  if (o.granularity() == v1::GRANULARITY_PER_KV_HEAD) p.granularity = Granularity::kPerKvHead;
  if (o.granularity() > v1::GRANULARITY_PER_KV_HEAD || o.granularity() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.granularity=", o.granularity(), " is unknown"));
  }
  return p;
}

v1::SelectOptions ToProto(const SelectPolicy& p) {
  v1::SelectOptions o;
  static constexpr v1::Method kMethods[] = {v1::METHOD_OFF, v1::METHOD_JL,    v1::METHOD_1PC,
                                            v1::METHOD_FRO, v1::METHOD_QUEST, v1::METHOD_QUEST_CLT};
  o.set_method(kMethods[static_cast<int>(p.method)]);
  o.set_alpha(p.alpha);
  o.set_first_n(p.first_n);
  o.set_last_n(p.last_n);
  o.set_top_pages(p.top_pages);
  o.set_strict(p.strict);
  o.set_heads(p.heads == HeadMode::kAll ? v1::HEAD_MODE_ALL : v1::HEAD_MODE_RETRIEVAL);
  o.set_retrieval_heads(std::string(p.retrieval_heads.begin(), p.retrieval_heads.end()));
  static constexpr v1::Budget kBudgets[] = {v1::BUDGET_THRESHOLD, v1::BUDGET_FIXED,
                                            v1::BUDGET_TOP_P, v1::BUDGET_MASS};
  o.set_budget(kBudgets[static_cast<int>(p.budget)]);
  o.set_top_p(p.top_p);
  o.set_mass_target(p.mass_target);
  o.set_mass_temperature(p.mass_temperature);
  o.set_min_pages(p.min_pages);
  o.set_max_pages(p.max_pages);
  o.set_coarse_candidates(p.coarse_candidates);
  o.set_mass_scope(p.mass_scope == MassScope::kHead ? v1::MASS_SCOPE_HEAD : v1::MASS_SCOPE_LIST);
  for (const MassSetting& m : p.mass_layers) {
    v1::MassSetting* out = o.add_mass_layers();
    out->set_target(m.target);
    out->set_temperature(m.temperature);
    out->set_min_pages(static_cast<uint32_t>(m.min_pages));
    out->set_max_pages(static_cast<uint32_t>(m.max_pages));
  }
  o.set_granularity(p.granularity == Granularity::kUnion ? v1::GRANULARITY_UNION
                                                         : v1::GRANULARITY_PER_KV_HEAD);
  return o;
}

void ToProto(const StepStats& s, uint64_t step, double prepass_us, v1::StepStats* out) {
  out->set_step(step);
  out->set_groups_total(s.groups_total);
  out->set_groups_visited(s.groups_visited);
  out->set_pages_total(s.blocks_total);
  out->set_pages_visited(s.blocks_visited);
  out->set_bytes_kv_dense(s.kv_bytes_dense);
  out->set_bytes_kv_read_est(s.kv_bytes_read_est);
  out->set_bytes_summary_read(s.summary_bytes_read);
  out->set_prepass_us(prepass_us);
}

absl::StatusOr<BackendKind> BackendFromProto(v1::Backend backend) {
  switch (backend) {
    case v1::BACKEND_UNSPECIFIED:
      return BackendKind::kAuto;
    case v1::BACKEND_CPU:
      return BackendKind::kCpu;
    case v1::BACKEND_CUDA:
      return BackendKind::kCuda;
    default:
      return absl::InvalidArgumentError(absl::StrCat("backend=", backend, " is unknown"));
  }
}

v1::Backend ToProto(BackendKind kind) {
  return kind == BackendKind::kCuda ? v1::BACKEND_CUDA : v1::BACKEND_CPU;
}

std::vector<StepRow> RowsFromProto(const google::protobuf::RepeatedPtrField<v1::BatchRow>& rows) {
  std::vector<StepRow> out;
  out.reserve(rows.size());
  for (const v1::BatchRow& r : rows) {
    out.push_back(
        {.table_row = r.table_row(), .context_tokens = r.context_tokens(), .seq_id = r.seq_id()});
  }
  return out;
}

void AppendVisitLists(const HostVisitLists& in, std::span<const StepRow> rows,
                      v1::SelectPagesResponse* response) {
  for (int layer = 0; layer < in.num_layers; ++layer) {
    for (size_t i = 0; i < rows.size(); ++i) {
      for (int list = 0; list < in.lists; ++list) {
        const int64_t index =
            (static_cast<int64_t>(layer) * in.max_batch + static_cast<int64_t>(i)) * in.lists +
            list;
        v1::VisitList* v = response->add_visit_lists();
        v->set_layer(layer);
        v->set_batch_index(static_cast<uint32_t>(i));
        v->set_kv_head(list);
        // The count as read, but never past the list's row: a count is only ever read
        // from epsd's own memory (Attach refuses shared counts beside inline lists), and
        // this keeps a corrupt one from reading outside it all the same.
        const int64_t count =
            std::clamp<int64_t>(in.counts[index], 0, static_cast<int64_t>(in.max_blocks));
        const int32_t* first = in.blocks + index * in.max_blocks;
        v->mutable_blocks()->Add(first, first + count);
        v->set_visited_tokens(VisitedTokens(count, rows[i].context_tokens, in.block_size));
      }
    }
  }
}

}  // namespace eps::service
