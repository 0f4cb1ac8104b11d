#include "core/layout.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace eps {
namespace {

// The range of each integer field; the relations between fields follow in Check.
struct FieldRange {
  const char* name;
  int ModelLayout::*field;
  int lo;
  int hi;
};
constexpr FieldRange kFieldRanges[] = {
    {"num_layers", &ModelLayout::num_layers, 1, 4096},
    {"num_q_heads", &ModelLayout::num_q_heads, 1, 4096},
    {"num_kv_heads", &ModelLayout::num_kv_heads, 1, 4096},
    {"head_dim", &ModelLayout::head_dim, 4, 1024},
    {"block_size", &ModelLayout::block_size, 1, 4096},
    {"group_blocks", &ModelLayout::group_blocks, 1, 1024},
    {"sketch_dim", &ModelLayout::sketch_dim, 1, 64},
};

LayoutRefusal Refuse(std::vector<int ModelLayout::*> fields, std::string message) {
  return {absl::InvalidArgumentError(message), std::move(fields)};
}

}  // namespace

std::optional<LayoutRefusal> ModelLayout::Check() const {
  for (const FieldRange& r : kFieldRanges) {
    const int value = this->*r.field;
    if (value < r.lo || value > r.hi) {
      return Refuse({r.field},
                    absl::StrCat(r.name, "=", value, " not in [", r.lo, ", ", r.hi, "]"));
    }
  }
  if (num_q_heads % num_kv_heads != 0) {
    return Refuse({&ModelLayout::num_q_heads, &ModelLayout::num_kv_heads},
                  absl::StrCat("num_q_heads=", num_q_heads,
                               " is not a multiple of num_kv_heads=", num_kv_heads));
  }
  if (coarse_blocks != 0 && (coarse_blocks <= group_blocks || coarse_blocks > 4096 ||
                             coarse_blocks % group_blocks != 0)) {
    return Refuse({&ModelLayout::coarse_blocks, &ModelLayout::group_blocks},
                  absl::StrCat("coarse_blocks=", coarse_blocks,
                               " must be 0 (no coarse level) or a multiple of group_blocks=",
                               group_blocks, " above it, at most 4096"));
  }
  if (head_dim % 4 != 0) {
    return Refuse({&ModelLayout::head_dim},
                  absl::StrCat("head_dim=", head_dim, " is not a multiple of 4"));
  }
  return std::nullopt;
}

absl::Status ModelLayout::Validate() const {
  std::optional<LayoutRefusal> refusal = Check();
  return refusal ? refusal->reason : absl::OkStatus();
}

std::string ModelLayout::DebugString() const {
  return absl::StrCat("layers=", num_layers, " q_heads=", num_q_heads, " kv_heads=", num_kv_heads,
                      " d=", head_dim, " block_size=", block_size, " group_blocks=", group_blocks,
                      " coarse_blocks=", coarse_blocks, " m=", sketch_dim, " seed=", phi_seed,
                      " key_sum=", features.key_sum, " principal=", features.principal,
                      " quest=", features.quest, " quest8=", features.quest8);
}

int Revision1QuestMin(const ModelLayout& model) {
  if (!model.features.quest) return -1;
  return PackedSize(model.sketch_dim) + 3 + (model.features.key_sum ? model.head_dim : 0);
}

bool LayoutDiffersFromRevision1(const ModelLayout& model) {
  return Revision1QuestMin(model) != SummaryLayout::For(model).quest_min;
}

SummaryLayout SummaryLayout::For(const ModelLayout& model) {
  SummaryLayout s;
  s.sketch_dim = model.sketch_dim;
  s.head_dim = model.head_dim;
  s.gram_words = PackedSize(model.sketch_dim);
  int next = s.gram_words;
  s.fro2 = next++;
  s.max_norm = next++;
  s.count = next++;
  if (model.features.key_sum) {
    s.key_sum = next;
    next += model.head_dim;
  }
  if (model.features.quest) {
    // On a 16-byte boundary, so that the GPU pre-pass copies it 16 bytes at a
    // time (gpu/questclt_octets.cuh); without the principal part the record's
    // size is the same as without the padding.
    next = (next + 3) / 4 * 4;
    s.quest_min = next;
    s.quest_max = next + model.head_dim / 2;  // head_dim is a multiple of 4
    next += model.head_dim;
  }
  if (model.features.principal) {
    s.principal = next;
    next += 3 + (model.head_dim + 3) / 4;
  }
  if (model.features.quest8) {
    // Last, so that the parts before it keep their revision-2 offsets; on a
    // 16-byte boundary for the GPU pre-pass's copies, as quest's.
    next = (next + 3) / 4 * 4;
    s.quest8 = next;
    next += model.head_dim / 2 + 1;
  }
  s.record_words = (next + 3) / 4 * 4;
  return s;
}

}  // namespace eps
