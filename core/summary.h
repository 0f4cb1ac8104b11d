// Writing EPS summaries from keys (docs/design.md §3): the engine-side math.
//
// The engine calls Append whenever it writes keys of a group (prefill or decode)
// and Seal once a group is full. Summaries are never rebuilt by re-reading K;
// Seal alone looks at the group's keys once more, to fit the principal pair.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "absl/status/status.h"
#include "core/half.h"
#include "core/layout.h"
#include "core/phi.h"

namespace eps {

// A run of keys of one (layer, KV head): `count` vectors of head_dim elements,
// `stride` elements apart, stored as `dtype` (float32, float16 or bfloat16).
struct KeyRows {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t count = 0;
  int64_t stride = 0;  // elements between consecutive keys; 0 means head_dim
};

// Updates summary records. Borrows the PhiBank, which must outlive it.
// Thread safety: const methods only; distinct records may be written concurrently.
class SummaryWriter {
 public:
  SummaryWriter(const ModelLayout& model, const PhiBank& phi);

  const SummaryLayout& layout() const { return layout_; }

  // Empties a record (no keys): zero sums, quest min = +inf, max = -inf, quest8
  // codes min = 127, max = -128 (below any key's code) and scale 0. Refuses a record
  // shorter than the layout's, touching nothing.
  absl::Status Reset(std::span<float> record) const;

  // Adds keys to the record of (layer, kv_head). Rejects non-finite keys, keys so large
  // that the record's sums would leave the float range (d·Σ‖k‖² ≥ FLT_MAX over the
  // record's keys: the Gram terms are bounded by it), and, with features.quest, keys
  // beyond the binary16 range, before touching the record; and a PhiBank that does not
  // serve the model (PhiCovers).
  absl::Status Append(std::span<float> record, int layer, int kv_head, const KeyRows& keys) const;

  // Fits the top-1 principal pair of the group's keys (all of them, as appended:
  // their count must equal the record's) and stores it; a no-op without
  // features.principal. A later Append clears the pair (1pc falls back to fro). The stored
  // direction is the int8-dequantised one and λ1 is measured along it, so the 1pc bound stays an
  // upper bound despite quantisation (docs/summaries.md).
  absl::Status Seal(std::span<float> record, int layer, int kv_head, const KeyRows& keys) const;

 private:
  // `appending`: the keys are added to the record's (Append), not its own (Seal).
  absl::Status CheckKeys(std::span<float> record, int layer, int kv_head, const KeyRows& keys,
                         bool appending) const;

  ModelLayout model_;
  SummaryLayout layout_;
  const PhiBank& phi_;
};

// Writes the empty record of `layout` into record[0, record_words): what
// SummaryWriter::Reset writes, and the bytes the device writer's Reset copies (one
// definition for every writer). Refuses a record shorter than the layout's, touching
// nothing.
absl::Status ResetRecord(const SummaryLayout& layout, std::span<float> record);

// Reads the int8 principal direction u1 of a record (head_dim values).
int8_t PrincipalComponent(std::span<const float> record, const SummaryLayout& layout, int i);

// The quest part: per-channel key minimum and maximum, stored as binary16
// (docs/summaries.md), the minimum rounded down and the maximum up. Keys beyond
// ±65504 cannot be summarised this way; Append rejects them when quest is on.
// Inline: the CPU scoring loops read two per channel and query head.
inline float ReadHalf(std::span<const float> record, int word, int i) {
  uint16_t bits;
  std::memcpy(&bits, reinterpret_cast<const std::byte*>(record.data() + word) + 2 * i, 2);
  return HalfToFloat(bits);
}
inline float QuestMin(std::span<const float> record, const SummaryLayout& layout, int i) {
  return ReadHalf(record, layout.quest_min, i);
}
inline float QuestMax(std::span<const float> record, const SummaryLayout& layout, int i) {
  return ReadHalf(record, layout.quest_max, i);
}

// The quest8 part: per-channel int8 codes of the key minimum (rounded down)
// and maximum (rounded up) in units of the record's scale, a power of two
// (0 while every key summarised is zero). Key channel i lies in
// [Quest8MinCode(i)·scale, Quest8MaxCode(i)·scale], exactly.
inline int Quest8MinCode(std::span<const float> record, const SummaryLayout& layout, int i) {
  return reinterpret_cast<const int8_t*>(record.data() + layout.quest8)[i];
}
inline int Quest8MaxCode(std::span<const float> record, const SummaryLayout& layout, int i) {
  return reinterpret_cast<const int8_t*>(record.data() + layout.quest8 + layout.head_dim / 4)[i];
}
inline float Quest8Scale(std::span<const float> record, const SummaryLayout& layout) {
  return record[layout.quest8 + layout.head_dim / 2];
}

// The smallest power of two s (at least 2^-149) with 127·s ≥ amax: the quest8
// scale of keys whose largest channel magnitude is amax > 0.
float Quest8ScaleFor(float amax);

}  // namespace eps
