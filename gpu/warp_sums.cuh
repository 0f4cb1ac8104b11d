// The per-channel sums of gpu/bounds.cuh (quest's channel sum; strict mode's
// q·Σk, quest sum and u1·q) for the records of a whole warp, read by the warp
// together. One thread walking its own record issues loads 32 records apart, a
// cache line per lane; here the lanes split each record's words (lane l reads
// words l, l + 32, ..., so each load instruction reads 128 contiguous bytes),
// several records per pass so that every lane has many loads in flight (the
// step is bound by latency, not bandwidth: docs/benchmarks/gpu.md), and one
// transposed warp reduction adds all of a pass's (record, head) sums at once.
//
// Sums run over the channels in another order than core/'s (lane by lane,
// then a tree), and products are contracted into FMAs: the results are a
// float rounding from core/'s, which strict mode's slack covers.
//
// jl needs no per-channel sums, only the Gram: StageWarpRecords copies a
// warp's records into shared memory the same coalesced way, and each thread
// then scores its own copy exactly as it would the record (bit for bit).
#pragma once

#include <cuda_fp16.h>
#include <cuda_pipeline.h>

#include <cstdint>
#include <type_traits>

#include "gpu/bounds.cuh"

namespace eps::gpu {

inline constexpr unsigned kFullWarp = 0xFFFFFFFFu;

constexpr int Log2(int x) { return x <= 1 ? 0 : 1 + Log2(x / 2); }

// Records per pass for a batch of kHeads heads: kValues (record, head) sums
// per pass, each part (quest: one; strict: up to three parts).
template <int kHeads, bool kStrict>
inline constexpr int kWarpRecords = (kStrict ? 16 : 32) / kHeads;

// Up to kRecords records of the warp, taken in lane order from `pending` (the
// lanes that still have a record). A missing record repeats rec[0], so every
// load stays in bounds without a branch; `mine` is this lane's record's index
// in the pass, or -1.
template <int kRecords>
struct WarpPass {
  const float* rec[kRecords];
  int mine;
};

template <int kRecords>
__device__ inline WarpPass<kRecords> NextWarpPass(unsigned& pending, unsigned long long address,
                                                  int lane) {
  WarpPass<kRecords> pass;
  pass.mine = -1;
  const int first = __ffs(pending) - 1;
#pragma unroll
  for (int k = 0; k < kRecords; ++k) {
    const int src = pending != 0 ? __ffs(pending) - 1 : first;
    if (pending != 0 && lane == src) pass.mine = k;
    pending &= pending - 1;
    pass.rec[k] = reinterpret_cast<const float*>(__shfl_sync(kFullWarp, address, src));
  }
  return pass;
}

// Sums v[i] over the warp's lanes for every i at once, in kValues - 1 + (5 -
// log2 kValues) shuffles instead of 5 per value: each level trades half of a
// lane's values with its partner, so after log2(kValues) levels lane l holds
// the partial sum of value l >> (5 - log2 kValues), which the remaining
// butterfly levels complete. Value i is then found in lane i << (5 - log2 kValues).
//
// TradeHalves is one level: the lane keeps the upper half of its values if
// (lane & kOffset), else the lower half, each plus its partner's copy kOffset
// lanes away.
template <int kValues, int kOffset>
__device__ __forceinline__ void TradeHalves(const float (&v)[kValues], int lane,
                                            float (&kept)[kValues / 2]) {
  constexpr int kHalf = kValues / 2;
  const bool upper = (lane & kOffset) != 0;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float send = upper ? v[i] : v[i + kHalf];
    kept[i] = (upper ? v[i + kHalf] : v[i]) + __shfl_xor_sync(kFullWarp, send, kOffset);
  }
}

template <int kValues, int kOffset = 16>
__device__ inline float WarpTransposeSum(float (&v)[kValues], int lane) {
  static_assert(kValues >= 1 && kValues <= 32 && (kValues & (kValues - 1)) == 0);
  if constexpr (kValues == 1) {
    float sum = v[0];
#pragma unroll
    for (int offset = kOffset; offset > 0; offset /= 2) {
      sum += __shfl_xor_sync(kFullWarp, sum, offset);
    }
    return sum;
  } else {
    float kept[kValues / 2];
    TradeHalves<kValues, kOffset>(v, lane, kept);
    return WarpTransposeSum<kValues / 2, kOffset / 2>(kept, lane);
  }
}

// Adds the pass's sums acc[record * kHeads + head] over the warp and hands each
// record's kHeads sums to the lane that owns the record (out[0, kHeads)).
template <int kRecords, int kHeads>
__device__ inline void DealSums(float (&acc)[kRecords * kHeads], int mine, float* out, int lane) {
  constexpr int kShift = 5 - Log2(kRecords * kHeads);
  const float total = WarpTransposeSum<kRecords * kHeads>(acc, lane);
  const int base = mine < 0 ? 0 : mine * kHeads;
#pragma unroll
  for (int r = 0; r < kHeads; ++r) {
    const float v = __shfl_sync(kFullWarp, total, (base + r) << kShift);
    if (mine >= 0) out[r] = v;
  }
}

// The query of quest's sign-split sum for word w of the quest part (d words:
// d/2 of min halves, then d/2 of max halves), two channels c, c + 1 per word:
// min(q_c, 0) for a min word, max(q_c, 0) for a max word. For a record with
// keys (all halves finite, min ≤ max) max(q·min, q·max) = min(q,0)·min +
// max(q,0)·max channel by channel, so each lane can sum the words it read
// without its partner's half of the pair. An empty record's ±inf halves give
// NaN here, but its bound is -inf whatever the sum (QuestBound).
__device__ inline float2 QuestSplitQuery(const float* q, int d, int w) {
  const bool low = w < d / 2;
  const int c = low ? 2 * w : 2 * (w - d / 2);
  return low ? make_float2(fminf(q[c], 0.0f), fminf(q[c + 1], 0.0f))
             : make_float2(fmaxf(q[c], 0.0f), fmaxf(q[c + 1], 0.0f));
}

// Loads, for every record of the pass, the lane's 4 words w0 + lane + 32j of
// the run starting at word `part` (`words` long); words past the run read as 0.
template <int kRecords, typename T>
__device__ inline void LoadPartWords(const WarpPass<kRecords>& pass, int part, int words, int w0,
                                     int lane, T (&out)[kRecords][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int w = w0 + 32 * j + lane;
#pragma unroll
    for (int k = 0; k < kRecords; ++k) {
      out[k][j] = w < words ? reinterpret_cast<const T*>(pass.rec[k] + part)[w] : T{};
    }
  }
}

// quest: Σ_j max(q_j min_j, q_j max_j) for the warp's records and kHeads heads
// (`heads` of them real). `rec` is the lane's record (null: none); `qsplit`
// [heads, d] float2 holds QuestSplitQuery of each head's words. Every lane of
// the warp must call it; out[0, kHeads) receives the lane's own record's sums.
template <int kHeads>
__device__ inline void QuestSumsWarp(const float* rec, const RecordOffsets& o, const float2* qsplit,
                                     int heads, float* out, int lane) {
  constexpr int kRecords = kWarpRecords<kHeads, false>;
  unsigned pending = __ballot_sync(kFullWarp, rec != nullptr);
  const auto address = reinterpret_cast<unsigned long long>(rec);
  while (pending != 0) {
    const WarpPass<kRecords> pass = NextWarpPass<kRecords>(pending, address, lane);
    float acc[kRecords * kHeads] = {};
    for (int w0 = 0; w0 < o.d; w0 += 128) {
      __half2 word[kRecords][4];  // zero past the part: halves 0, which add 0
      LoadPartWords(pass, o.quest_min, o.d, w0, lane, word);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (w0 + 32 * j >= o.d) break;  // past the run: words of zeros
        const int w = min(w0 + 32 * j + lane, o.d - 1);
#pragma unroll
        for (int r = 0; r < kHeads; ++r) {
          const float2 qv = qsplit[(r < heads ? r : 0) * o.d + w];
#pragma unroll
          for (int k = 0; k < kRecords; ++k) {
            const float2 x = __half22float2(word[k][j]);
            float& a = acc[k * kHeads + r];
            a = fmaf(qv.y, x.y, fmaf(qv.x, x.x, a));
          }
        }
      }
    }
    DealSums<kRecords, kHeads>(acc, pass.mine, out, lane);
  }
}

// Strict mode's three sums (HeadSums: q·Σk, the quest sum, u1·q), each when
// the record holds its part, for the warp's records; as QuestSumsWarp. `q`
// [heads, d] holds the widened queries.
template <int kHeads>
__device__ inline void BracketSumsWarp(const float* rec, const RecordOffsets& o, const float* q,
                                       const float2* qsplit, int heads, HeadSums& sums, int lane) {
  constexpr int kRecords = kWarpRecords<kHeads, true>;
  unsigned pending = __ballot_sync(kFullWarp, rec != nullptr);
  const auto address = reinterpret_cast<unsigned long long>(rec);
  const bool has_key = o.key_sum >= 0, has_quest = o.quest_min >= 0, has_pc = o.principal >= 0;
  while (pending != 0) {
    const WarpPass<kRecords> pass = NextWarpPass<kRecords>(pending, address, lane);
    float key[kRecords * kHeads] = {}, quest[kRecords * kHeads] = {};
    // q·Σk and the quest sum: two runs of d words each, loaded together.
    for (int w0 = 0; w0 < o.d && (has_key || has_quest); w0 += 128) {
      float kw[kRecords][4];
      __half2 qw[kRecords][4];
      LoadPartWords(pass, has_key ? o.key_sum : 0, has_key ? o.d : 0, w0, lane, kw);
      LoadPartWords(pass, has_quest ? o.quest_min : 0, has_quest ? o.d : 0, w0, lane, qw);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (w0 + 32 * j >= o.d) break;  // past the run: words of zeros
        const int w = min(w0 + 32 * j + lane, o.d - 1);
#pragma unroll
        for (int r = 0; r < kHeads; ++r) {
          const int hr = r < heads ? r : 0;
          const float qk = q[hr * o.d + w];
          const float2 qv = qsplit[hr * o.d + w];
#pragma unroll
          for (int k = 0; k < kRecords; ++k) {
            key[k * kHeads + r] = fmaf(qk, kw[k][j], key[k * kHeads + r]);
            const float2 x = __half22float2(qw[k][j]);
            float& a = quest[k * kHeads + r];
            a = fmaf(qv.y, x.y, fmaf(qv.x, x.x, a));
          }
        }
      }
    }
    if (has_key) DealSums<kRecords, kHeads>(key, pass.mine, sums.key_sum, lane);
    if (has_quest) DealSums<kRecords, kHeads>(quest, pass.mine, sums.quest, lane);
    if (has_pc) {
      // u1·q: d/4 words of four int8 each, after λ1, r² and the scale.
      float dot[kRecords * kHeads] = {};
      for (int w0 = 0; w0 < o.d / 4; w0 += 128) {
        char4 uw[kRecords][4];
        LoadPartWords(pass, o.principal + 3, o.d / 4, w0, lane, uw);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (w0 + 32 * j >= o.d / 4) break;  // past the run: words of zeros
          const int w = min(w0 + 32 * j + lane, o.d / 4 - 1);
#pragma unroll
          for (int r = 0; r < kHeads; ++r) {
            const float4 qv = reinterpret_cast<const float4*>(q + (r < heads ? r : 0) * o.d)[w];
#pragma unroll
            for (int k = 0; k < kRecords; ++k) {
              const char4 u = uw[k][j];
              float& a = dot[k * kHeads + r];
              a = fmaf(static_cast<float>(u.x), qv.x, a);
              a = fmaf(static_cast<float>(u.y), qv.y, a);
              a = fmaf(static_cast<float>(u.z), qv.z, a);
              a = fmaf(static_cast<float>(u.w), qv.w, a);
            }
          }
        }
      }
      DealSums<kRecords, kHeads>(dot, pass.mine, sums.principal, lane);
    }
  }
}

// questclt's sums over one word w (channels 2w, 2w + 1) of each of a pass's
// records, lo[k] and hi[k] its min and max halves, for kHeads heads of the
// widened queries `q` [heads, d]. Per record and channel, once for every head:
// lo + hi and (hi − lo)²; the halves and quarters go on the query (q/2 and
// q²/4), so a head adds four FMAs per word: centre += (q/2)·(lo + hi),
// spread += (q²/4)·(hi − lo)².
template <int kRecords, int kHeads>
__device__ __forceinline__ void QuestCltAddWord(const __half2 (&lo)[kRecords],
                                                const __half2 (&hi)[kRecords], const float* q,
                                                int heads, int d, int w,
                                                float (&centre)[kRecords * kHeads],
                                                float (&spread)[kRecords * kHeads]) {
  float2 sum[kRecords], width2[kRecords];
#pragma unroll
  for (int k = 0; k < kRecords; ++k) {
    const float2 l = __half22float2(lo[k]), u = __half22float2(hi[k]);
    sum[k] = make_float2(l.x + u.x, l.y + u.y);
    const float dx = u.x - l.x, dy = u.y - l.y;
    width2[k] = make_float2(dx * dx, dy * dy);
  }
#pragma unroll
  for (int r = 0; r < kHeads; ++r) {
    const float2 qv = reinterpret_cast<const float2*>(q + (r < heads ? r : 0) * d)[w];
    const float cx = 0.5f * qv.x, cy = 0.5f * qv.y;
    const float sx = 0.25f * qv.x * qv.x, sy = 0.25f * qv.y * qv.y;
#pragma unroll
    for (int k = 0; k < kRecords; ++k) {
      float& c = centre[k * kHeads + r];
      c = fmaf(cy, sum[k].y, fmaf(cx, sum[k].x, c));
      float& v = spread[k * kHeads + r];
      v = fmaf(sy, width2[k].y, fmaf(sx, width2[k].x, v));
    }
  }
}

// Code c (0-3) of a word of four int8 codes, lowest byte first, sign-extended
// (the word stays one register: a char4 would take four).
__device__ __forceinline__ int Code(int word, int c) { return (word << (24 - 8 * c)) >> 24; }

// QuestCltAddWord for the quest8 part: word w holds four int8 codes (channels
// 4w … 4w + 3) of each record's minima (lo) and maxima (hi); per head one
// 16-byte load of the widened query. The sums are in code units.
template <int kRecords, int kHeads>
__device__ __forceinline__ void QuestCltAddWord(const int (&lo)[kRecords],
                                                const int (&hi)[kRecords], const float* q,
                                                int heads, int d, int w,
                                                float (&centre)[kRecords * kHeads],
                                                float (&spread)[kRecords * kHeads]) {
  float sum[kRecords][4], width2[kRecords][4];
#pragma unroll
  for (int k = 0; k < kRecords; ++k) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int l = Code(lo[k], c), u = Code(hi[k], c);
      sum[k][c] = static_cast<float>(l + u);
      const float dw = static_cast<float>(u - l);
      width2[k][c] = dw * dw;
    }
  }
#pragma unroll
  for (int r = 0; r < kHeads; ++r) {
    const float4 qv = reinterpret_cast<const float4*>(q + (r < heads ? r : 0) * d)[w];
    const float half[4] = {0.5f * qv.x, 0.5f * qv.y, 0.5f * qv.z, 0.5f * qv.w};
#pragma unroll
    for (int k = 0; k < kRecords; ++k) {
      float& a = centre[k * kHeads + r];
      float& b = spread[k * kHeads + r];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        a = fmaf(half[c], sum[k][c], a);
        b = fmaf(half[c] * half[c], width2[k][c], b);
      }
    }
  }
}

// questclt's two sums (HeadSums centre and spread) for the warp's records, as
// QuestSumsWarp: lane l reads minimum word w and its maximum word for w = l,
// l + 32, ... of the part questclt reads; `q` [heads, d] holds the widened
// queries. Two sums per (record, head): half of quest's records per pass, so
// that the words and sums of a pass stay in registers.
//   binary16 part (kQuest8 false): d/2 words of min halves, then d/2 of max
//     halves, two channels 2w, 2w + 1 a word (core/layout.h);
//   quest8 part: d/4 words of four int8 minima, then d/4 of maxima, channels
//     4w … 4w + 3 a word; the sums are in code units and QuestCltScore applies
//     the record's scale.
template <int kHeads, bool kQuest8>
__device__ inline void QuestCltSumsWarp(const float* rec, const RecordOffsets& o, const float* q,
                                        int heads, HeadSums& sums, int lane) {
  using Word = std::conditional_t<kQuest8, int, __half2>;
  constexpr int kRecords = kWarpRecords<kHeads, true>;
  unsigned pending = __ballot_sync(kFullWarp, rec != nullptr);
  const auto address = reinterpret_cast<unsigned long long>(rec);
  const int words = kQuest8 ? o.d / 4 : o.d / 2;  // a part's minima, then as many maxima
  const int first = kQuest8 ? o.quest8 : o.quest_min;
  while (pending != 0) {
    const WarpPass<kRecords> pass = NextWarpPass<kRecords>(pending, address, lane);
    float centre[kRecords * kHeads] = {}, spread[kRecords * kHeads] = {};
    for (int w0 = 0; w0 < words; w0 += 128) {
      Word lo[kRecords][4], hi[kRecords][4];  // zero past the part: adds 0
      LoadPartWords(pass, first, words, w0, lane, lo);
      LoadPartWords(pass, first + words, words, w0, lane, hi);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (w0 + 32 * j >= words) break;  // past the run: words of zeros
        const int w = min(w0 + 32 * j + lane, words - 1);
        Word l[kRecords], u[kRecords];
#pragma unroll
        for (int k = 0; k < kRecords; ++k) {
          l[k] = lo[k][j];
          u[k] = hi[k][j];
        }
        QuestCltAddWord<kRecords, kHeads>(l, u, q, heads, o.d, w, centre, spread);
      }
    }
    DealSums<kRecords, kHeads>(centre, pass.mine, sums.centre, lane);
    DealSums<kRecords, kHeads>(spread, pass.mine, sums.spread, lane);
  }
}

// jl's staged record (ScoreKernel with m known): the packed Gram and the three
// statistics, rounded up to 16 bytes ...
constexpr int StagedWords(int m) { return (m * (m + 1) / 2 + 3 + 3) / 4 * 4; }
// ... at a stride of an odd number of 16-byte pieces, so that the eight lanes
// of a quarter warp reading a float4 of their own records hit distinct banks.
constexpr int StagedStride(int m) {
  return StagedWords(m) + ((StagedWords(m) / 4) % 2 == 0 ? 4 : 0);
}

// Copies the first kWords words of each lane's record (null: none) to
// stage + lane * kStride, with cp.async: piece c of the warp's 32 * kWords / 4
// sixteen-byte pieces goes to lane c % 32, so each copy instruction reads
// consecutive pieces of consecutive records (a thread per record reads 32
// records 16 bytes at a time, a cache line per lane). Returns once they are
// queued: WaitStagedRecords waits for them. Records are 16-byte aligned
// (core/layout.h pads them).
template <int kWords, int kStride>
__device__ inline void StageWarpRecords(const float* rec, float* stage, int lane) {
  static_assert(kWords % 4 == 0 && kStride % 4 == 0 && kStride >= kWords);
  constexpr int kPieces = kWords / 4;
  const auto address = reinterpret_cast<unsigned long long>(rec);
#pragma unroll
  for (int i = 0; i < kPieces; ++i) {
    const int c = 32 * i + lane, k = c / kPieces, v = c % kPieces;
    const auto* src = reinterpret_cast<const float4*>(__shfl_sync(kFullWarp, address, k));
    if (src != nullptr) __pipeline_memcpy_async(stage + k * kStride + 4 * v, src + v, 16);
  }
  __pipeline_commit();
}

// Waits until the warp's StageWarpRecords copies have landed.
__device__ inline void WaitStagedRecords() {
  __pipeline_wait_prior(0);
  __syncwarp();
}

}  // namespace eps::gpu
