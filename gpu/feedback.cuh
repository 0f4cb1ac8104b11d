// Selection feedback in the GPU pre-pass (core/step.h StepInputs::feedback, core
// ApplyFeedback): two kernels around the selection.
//
//   FeedbackKernel  per (layer * q_heads + head, row), scored heads only, after
//                   scoring and before the selection: the head's median of
//                   (√d·entry − score) over the groups with a finite entry and a
//                   finite score (the mean of the two middle values for an even
//                   count, 0 for none); then every group with a finite entry
//                   scores √d·entry, every other finite score gains the median,
//                   −∞ stays −∞. In double with explicit roundings (no fused
//                   multiply-add), as core/ computes, so equal inputs give equal
//                   scores.
//   ConsumeKernel   per (layer * q_heads + head, row), after the selection: when
//                   the step's report says OK, every entry of the row's groups
//                   becomes NaN (consumed); a failed step leaves them.
//
// The median: one pass over the head's groups computes each fed group's
// difference once, as a 64-bit key with the order of the doubles, and packs the
// keys into shared memory (the launch gives room for the longest row's groups,
// FeedbackSharedBytes); 8-bit radix passes over those keys then find the upper
// middle key, stopping as soon as one key carries the digits chosen, and one
// last pass finds the key below it (for an even count). Each block is short and
// mostly waiting at barriers or loads, so blocks are small (128 threads) for many
// of them to share an SM, and a thread loads 8 groups at once. Measured on an
// H100 (docs/benchmarks/gpu-history-2026-11-26-sessions-3-7.md, "Selection feedback's
// kernel, 2026-11-26"): 256 threads a block, or 64, and 4 groups a load were no faster.
//
// Shapes: feedback [layers, max_seqs, q_heads, max_groups] fp32 by table row;
// scores [max_batch, layers, q_heads, max_groups] fp32 (the selector's scratch);
// keys [the launch's key capacity] u64 in dynamic shared memory.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gpu/step_shape.cuh"

namespace eps::gpu::kernels {

constexpr int kFeedbackThreads = 128;
constexpr int kFeedbackWarps = kFeedbackThreads / 32;
constexpr int kFeedbackBins = 256;  // an 8-bit digit
constexpr int kFeedbackChunk = 8;   // groups a thread loads at once
constexpr int kBinsPerThread = kFeedbackBins / kFeedbackThreads;
static_assert(kFeedbackBins % kFeedbackThreads == 0, "each thread scans whole bins");

struct FeedbackArgs {
  float* feedback;        // [layers, max_seqs, q_heads, max_groups]
  const DeviceRow* rows;  // the step's rows
  const uint8_t* scored;  // [layers, q_heads] or null (every head scored)
  float* scores;          // [max_batch, layers, q_heads, max_groups]
  const StepReport* report;
  double sqrt_d;  // √d in double, as core/
};

// FeedbackKernel's dynamic shared memory: a key for each of up to `groups` groups
// (at least the longest row's; kMaxGroups' 8,192 take 64 KiB).
// Padded to whole 16 bytes, as the selection's words are (gpu/step.cu SelectSharedBytes):
// a 16-byte load of the last two keys stays inside the allocation.
inline size_t FeedbackSharedBytes(int64_t groups) {
  return static_cast<size_t>((groups + 1) / 2 * 2) * sizeof(unsigned long long);
}

// Double -> 64-bit key with the same order (finite values only; −0 below +0).
__device__ inline unsigned long long OrderedKey64(double x) {
  const unsigned long long bits = static_cast<unsigned long long>(__double_as_longlong(x));
  return (bits >> 63) ? ~bits : bits | (1ull << 63);
}
__device__ inline double KeyToDouble(unsigned long long key) {
  return __longlong_as_double(static_cast<long long>((key >> 63) ? key & ~(1ull << 63) : ~key));
}

// √d·entry − score, rounded as core/'s `scale * entry[p] - scores[p]` in double.
__device__ inline double FeedbackDiff(double sqrt_d, float entry, float score) {
  return __dsub_rn(__dmul_rn(sqrt_d, static_cast<double>(entry)), static_cast<double>(score));
}

// The block's shared state of one median besides the keys.
struct MedianScratch {
  unsigned histogram[kFeedbackBins];  // the current digit's counts
  unsigned warp_sums[kFeedbackWarps];
  unsigned count;                   // fed groups: keys packed so far
  unsigned digit, rest, bin_count;  // the bin chosen, the rank left in it, its keys
  unsigned long long found, below;  // the k-th key; the largest key under it
};

// Adds the lanes that `take` to histogram[digit], one atomic per distinct digit
// of the warp (the top digits of a head's keys are mostly equal). Every lane of
// the warp calls it.
__device__ inline void CountDigit(unsigned* histogram, bool take, unsigned digit) {
  const unsigned taking = __ballot_sync(0xFFFFFFFFu, take);
  if (!take) return;
  const unsigned peers = __match_any_sync(taking, digit);
  if (static_cast<int>(threadIdx.x % 32) == __ffs(static_cast<int>(peers)) - 1) {
    atomicAdd(&histogram[digit], static_cast<unsigned>(__popc(peers)));
  }
}

// The largest of the warp's values, to every lane.
__device__ inline unsigned long long WarpMax(unsigned long long v) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const unsigned long long other = __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

// The k-th smallest (from 0) of keys[0, c) (k < c) and, in *below, the (k−1)-th
// (k ≥ 1; unspecified for k = 0), every thread of the block getting both. Expects
// r.histogram to hold the counts of the keys' top digits (bits 56..63), r.found
// and r.below 0, and a barrier since. Radix passes from the top digit narrow a
// prefix; the pass whose bin holds one key, or the last, ends the narrowing, and
// one more pass over the keys reads the key under the prefix and the largest
// below it.
__device__ unsigned long long SharedKthSmallest(const unsigned long long* keys, unsigned c,
                                                unsigned k, MedianScratch& r,
                                                unsigned long long* below) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  unsigned long long prefix = 0, mask = 0;
  unsigned rest = k, bin_count = c;
  for (int shift = 56;; shift -= 8) {
    if (shift < 56) {  // the top digit's counts came with the packing
      for (int b = threadIdx.x; b < kFeedbackBins; b += kFeedbackThreads) r.histogram[b] = 0;
      __syncthreads();
      for (unsigned i0 = 0; i0 < c; i0 += kFeedbackThreads) {
        const unsigned i = i0 + threadIdx.x;
        const unsigned long long key = i < c ? keys[i] : 0;
        CountDigit(r.histogram, i < c && (key & mask) == prefix,
                   static_cast<unsigned>(key >> shift) & 0xFF);
      }
      __syncthreads();
    }
    // Thread t's bins [t·B, t·B + B): their keys, then the keys of all lower bins
    // by a scan over the warps; the bin in which the rank `rest` falls is chosen.
    unsigned mine[kBinsPerThread], sum = 0;
    for (int j = 0; j < kBinsPerThread; ++j) {
      mine[j] = r.histogram[threadIdx.x * kBinsPerThread + j];
      sum += mine[j];
    }
    unsigned inclusive = sum;
    for (int offset = 1; offset < 32; offset *= 2) {
      const unsigned up = __shfl_up_sync(0xFFFFFFFFu, inclusive, offset);
      if (lane >= offset) inclusive += up;
    }
    if (lane == 31) r.warp_sums[warp] = inclusive;
    __syncthreads();
    unsigned before = inclusive - sum;
    for (int w = 0; w < warp; ++w) before += r.warp_sums[w];
    for (int j = 0; j < kBinsPerThread; ++j) {
      if (before <= rest && rest < before + mine[j]) {
        r.digit = threadIdx.x * kBinsPerThread + j;
        r.rest = rest - before;
        r.bin_count = mine[j];
      }
      before += mine[j];
    }
    __syncthreads();
    prefix |= static_cast<unsigned long long>(r.digit) << shift;
    mask |= 0xFFull << shift;
    rest = r.rest;
    bin_count = r.bin_count;
    // The next pass's writes to r.digit, r.rest and r.bin_count come after two
    // barriers, so every thread has read them.
    if (bin_count == 1 || shift == 0) break;
  }
  // One key carries the prefix (or the prefix is a whole key, which every key
  // carrying it equals): it is the k-th. The keys below it are those whose digits
  // so far are below the prefix.
  unsigned long long found = 0, under = 0;
  for (unsigned i = threadIdx.x; i < c; i += kFeedbackThreads) {
    const unsigned long long key = keys[i], digits = key & mask;
    if (digits == prefix) found = key;
    if (digits < prefix && key > under) under = key;
  }
  found = WarpMax(found);
  under = WarpMax(under);
  if (lane == 0) {
    if (found != 0) atomicMax(&r.found, found);
    if (under != 0) atomicMax(&r.below, under);
  }
  __syncthreads();
  found = r.found;
  // With `rest` keys equal to the k-th ranked before it, the (k−1)-th equals it.
  *below = rest > 0 ? found : r.below;
  return found;
}

__global__ void __launch_bounds__(kFeedbackThreads) FeedbackKernel(Shape s, FeedbackArgs a) {
  extern __shared__ unsigned long long feedback_keys[];  // [the longest row's groups]
  __shared__ MedianScratch r;
  const int layer = blockIdx.x / s.q_heads, h = blockIdx.x % s.q_heads, row = blockIdx.y;
  if (a.scored != nullptr && !a.scored[layer * s.q_heads + h]) return;
  const int n = GroupsOf(s, a.rows[row].context_tokens);
  const float* entry =
      a.feedback +
      ((int64_t{layer} * s.max_seqs + a.rows[row].table_row) * s.q_heads + h) * s.max_groups;
  float* scores = a.scores + ((int64_t{row} * s.layers + layer) * s.q_heads + h) * s.max_groups;
  for (int b = threadIdx.x; b < kFeedbackBins; b += kFeedbackThreads) r.histogram[b] = 0;
  if (threadIdx.x == 0) {
    r.count = 0;
    r.found = 0;
    r.below = 0;
  }
  __syncthreads();
  // The fed groups' keys, packed in any order (a k-th smallest needs none), one
  // shared atomic per warp; their top digits counted on the way. A thread loads
  // kFeedbackChunk groups' entries and scores at once, so that their latencies
  // overlap; a row of one chunk (up to kFeedbackThreads · kFeedbackChunk groups)
  // keeps them in registers for the rewrite below.
  constexpr int kStride = kFeedbackThreads * kFeedbackChunk;
  const int lane = threadIdx.x % 32;
  float e[kFeedbackChunk], score[kFeedbackChunk];
  auto load = [&](int p0) {
#pragma unroll
    for (int j = 0; j < kFeedbackChunk; ++j) {
      const int p = p0 + j * kFeedbackThreads + static_cast<int>(threadIdx.x);
      e[j] = p < n ? entry[p] : __int_as_float(0x7FC00000);
      score[j] = p < n ? scores[p] : __int_as_float(0x7FC00000);
    }
  };
  for (int p0 = 0; p0 < n; p0 += kStride) {
    load(p0);
#pragma unroll
    for (int j = 0; j < kFeedbackChunk; ++j) {
      const bool fed = fabsf(e[j]) <= kFeedbackMax && isfinite(score[j]);
      const unsigned long long key = fed ? OrderedKey64(FeedbackDiff(a.sqrt_d, e[j], score[j])) : 0;
      const unsigned ballot = __ballot_sync(0xFFFFFFFFu, fed);
      unsigned base = 0;
      if (lane == 0 && ballot != 0) {
        base = atomicAdd(&r.count, static_cast<unsigned>(__popc(ballot)));
      }
      base = __shfl_sync(0xFFFFFFFFu, base, 0);
      if (fed) feedback_keys[base + __popc(ballot & ((1u << lane) - 1))] = key;
      CountDigit(r.histogram, fed, static_cast<unsigned>(key >> 56));
    }
  }
  __syncthreads();
  const unsigned c = r.count;
  double offset = 0.0;
  if (c > 0) {
    // core/: the (c/2)-th smallest; for an even count, the mean with the one below.
    unsigned long long below = 0;
    offset = KeyToDouble(SharedKthSmallest(feedback_keys, c, c / 2, r, &below));
    if (c % 2 == 0) offset = __dmul_rn(0.5, __dadd_rn(offset, KeyToDouble(below)));
  }
  // Each thread rewrites the groups it read above, and only those.
  for (int p0 = 0; p0 < n; p0 += kStride) {
    if (n > kStride) load(p0);  // else the one chunk is still in registers
#pragma unroll
    for (int j = 0; j < kFeedbackChunk; ++j) {
      const int p = p0 + j * kFeedbackThreads + static_cast<int>(threadIdx.x);
      if (fabsf(e[j]) <= kFeedbackMax) {  // core IsFeedback
        scores[p] = static_cast<float>(__dmul_rn(a.sqrt_d, static_cast<double>(e[j])));
      } else if (isfinite(score[j])) {
        scores[p] = static_cast<float>(__dadd_rn(static_cast<double>(score[j]), offset));
      }
    }
  }
}

__global__ void __launch_bounds__(kFeedbackThreads) ConsumeKernel(Shape s, FeedbackArgs a) {
  if (a.report->status.code != kOk) return;  // a failed step leaves the entries
  const int layer = blockIdx.x / s.q_heads, h = blockIdx.x % s.q_heads, row = blockIdx.y;
  const int n = GroupsOf(s, a.rows[row].context_tokens);
  float* entry =
      a.feedback +
      ((int64_t{layer} * s.max_seqs + a.rows[row].table_row) * s.q_heads + h) * s.max_groups;
  for (int p = threadIdx.x; p < n; p += kFeedbackThreads) entry[p] = __int_as_float(0x7FC00000);
}

}  // namespace eps::gpu::kernels
