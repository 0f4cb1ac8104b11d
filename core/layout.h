// The shapes every part of epsd agrees on: the model, the summary record, and
// the pool of records (docs/design.md §2, §3, §5).
//
// A summary record is the EPS summary of one (slot, layer, KV head): a run of
// 4-byte words, padded to 16 bytes. Word offsets (P = m(m+1)/2):
//
//   [0, P)         G, the packed upper triangle of Σ y yᵀ, row-major (i ≤ j)
//   P, P+1, P+2    fro2 = Σ‖k‖², max_norm = max ‖k‖, count (as float)
//   key_sum        d floats: Σ k                          (if features.key_sum)
//   quest          d binary16 min_j, then d binary16 max_j, two per word, low
//                  half first: d words (if features.quest), starting at a
//                  multiple of 4 words (padding before it); min rounded down,
//                  max rounded up, so the quest bound stays an upper bound
//   principal      λ1, r², scale, then d int8 u1 packed 4 per word
//                                                         (if features.principal)
//   quest8         d int8 minimum codes, then d int8 maximum codes (4 per word,
//                  channel order), then the scale s: d/2 + 1 words (if
//                  features.quest8), starting at a multiple of 4 words. A
//                  key's channel lies in [min·s, max·s]; s is a power of two,
//                  so an appended key requantizes the codes exactly (floor for
//                  minima, ceil for maxima) and the record does not depend on
//                  the order the keys came in (docs/summaries.md)
//
// The pool is [slots, layers, kv_heads, record_words] fp32, row-major.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/half.h"

namespace eps {

// Optional parts of a summary record; the packed Gram and the norms are always there.
struct SummaryFeatures {
  bool key_sum = true;     // Mean key: a lower bound of max_i q·k_i (strict mode).
  bool principal = false;  // Top-1 principal pair: the `1pc` bound.
  bool quest = true;       // Per-channel key min/max: the `quest` bound (the default method).
  bool quest8 = false;     // The same in 8 bits a channel: what questclt reads when present.
};

struct LayoutRefusal;

// The model and paging shape a session attaches with.
struct ModelLayout {
  int num_layers = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 16;   // tokens per engine KV block
  int group_blocks = 2;  // g: blocks per summary group (docs/eval/README.md, "Defaults chosen")
  // The coarse level (docs/policy-selection.md, "Coarse-to-fine"): 0 for none, else blocks per
  // coarse group, a multiple of group_blocks above it. Its records (the same layout)
  // live in a second pool; the selection scores them first and reads the records of
  // the groups inside the best coarse groups only.
  int coarse_blocks = 0;
  int sketch_dim = 8;  // m
  uint64_t phi_seed = 0;
  DType kv_dtype = DType::kFloat16;  // element type of the engine's K and V (byte estimates)
  SummaryFeatures features;

  int group_tokens() const { return block_size * group_blocks; }
  bool has_coarse_level() const { return coarse_blocks > 0; }
  // Groups per coarse group (the coarse level's r); 0 without one.
  int coarse_ratio() const { return coarse_blocks > 0 ? coarse_blocks / group_blocks : 0; }
  int gqa_ratio() const { return num_q_heads / num_kv_heads; }
  int kv_head_of(int q_head) const { return q_head / gqa_ratio(); }

  // Checks every field and their relations; the message names the offending field.
  absl::Status Validate() const;
  // The same check, with the fields the first broken rule reads; nullopt when valid.
  std::optional<LayoutRefusal> Check() const;
  std::string DebugString() const;
};

// What ModelLayout::Check refuses: Validate's status (InvalidArgument, naming the fields
// and their values) and the fields of the rule it breaks (one for a range, the two a
// relation ties), so that a caller that set them from inputs of its own (eps-load's
// shape flags) can name those inputs and give this reason, whatever the ranges are.
struct LayoutRefusal {
  absl::Status reason;
  std::vector<int ModelLayout::*> fields;
};

// Word offsets inside one summary record (see the file comment).
struct SummaryLayout {
  int sketch_dim = 0;
  int head_dim = 0;
  int gram_words = 0;  // P = m(m+1)/2
  int fro2 = 0;        // offsets of the scalar statistics
  int max_norm = 0;
  int count = 0;
  int key_sum = -1;      // -1 when the feature is off
  int quest_min = -1;    // word offsets of the binary16 min and max halves
  int quest_max = -1;    // (d/2 words each; QuestMin/QuestMax in core/summary.h read them)
  int principal = -1;    // λ1 at +0, r² at +1, scale at +2, u1 bytes from +3
  int quest8 = -1;       // min codes from +0, max codes from +d/4, the scale at +d/2
  int record_words = 0;  // multiple of 4

  static SummaryLayout For(const ModelLayout& model);
  int64_t record_bytes() const { return int64_t{record_words} * 4; }
};

// The revision of the record layout above that this build writes and reads.
// Engines say which one they write (ModelLayout.summary_layout in the API, 0
// meaning 1), and epsd refuses a session whose records would be read at other
// offsets than they were written (service/convert.cc). Revisions:
//   1  every part follows the one before it directly;
//   2  the quest part starts at a multiple of 4 words (since 2026-11-25);
//   3  the quest8 part may follow every other part (since 2026-11-26); records
//      without it are those of revision 2.
inline constexpr int kSummaryLayoutRevision = 3;

// The word revision 1 put the quest part at (-1 without one), and whether a
// record of `model` has its parts at other word offsets in revision 1 than in
// the current one: only the quest part (and the principal part after it) moved,
// and only when the words before it are not a multiple of 4.
int Revision1QuestMin(const ModelLayout& model);
bool LayoutDiffersFromRevision1(const ModelLayout& model);

// Number of packed words of a symmetric m×m matrix.
constexpr int PackedSize(int m) { return m * (m + 1) / 2; }

// Index of (i, j), i ≤ j, in the packed upper triangle, row-major.
constexpr int PackedIndex(int m, int i, int j) { return i * m - i * (i - 1) / 2 + (j - i); }

// Blocks and groups of a context of `tokens` tokens (ceil divisions; 0 for
// tokens <= 0). Written so that no int64 value, however near the limit, can
// overflow: a request's context length reaches here before it is bounded.
inline int64_t BlocksFor(int64_t tokens, int block_size) {
  return tokens <= 0 ? 0 : (tokens - 1) / block_size + 1;
}
inline int64_t GroupsFor(int64_t tokens, const ModelLayout& model) {
  const int64_t blocks = BlocksFor(tokens, model.block_size);
  return blocks <= 0 ? 0 : (blocks - 1) / model.group_blocks + 1;
}
// Coarse groups of a context (0 without a coarse level).
inline int64_t CoarseGroupsFor(int64_t tokens, const ModelLayout& model) {
  const int64_t blocks = BlocksFor(tokens, model.block_size);
  return blocks <= 0 || model.coarse_blocks <= 0 ? 0 : (blocks - 1) / model.coarse_blocks + 1;
}

}  // namespace eps
