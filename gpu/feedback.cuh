// Selection feedback in the GPU pre-pass (core/step.h StepInputs::feedback, core
// ApplyFeedback): two kernels around the selection.
//
//   FeedbackKernel  per (layer * q_heads + head, row), scored heads only, after
//                   scoring and before the selection: the head's median of
//                   (√d·entry − score) over the groups with a finite entry and a
//                   finite score, by 8-bit radix passes over 64-bit keys of the
//                   doubles (the mean of the two middle values for an even
//                   count, 0 for none); then every group with a finite entry
//                   scores √d·entry, every other finite score gains the median,
//                   −∞ stays −∞. In double with explicit roundings (no fused
//                   multiply-add), as core/ computes, so equal inputs give equal
//                   scores.
//   ConsumeKernel   per (layer * q_heads + head, row), after the selection: when
//                   the step's report says OK, every entry of the row's groups
//                   becomes NaN (consumed); a failed step leaves them.
//
// Shapes: feedback [layers, max_seqs, q_heads, max_groups] fp32 by table row;
// scores [max_batch, layers, q_heads, max_groups] fp32 (the selector's scratch).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/step_shape.cuh"

namespace eps::gpu::kernels {

constexpr int kFeedbackThreads = 256;

struct FeedbackArgs {
  float* feedback;        // [layers, max_seqs, q_heads, max_groups]
  const DeviceRow* rows;  // the step's rows
  const uint8_t* scored;  // [layers, q_heads] or null (every head scored)
  float* scores;          // [max_batch, layers, q_heads, max_groups]
  const StepReport* report;
  double sqrt_d;  // √d in double, as core/
};

// Double -> 64-bit key with the same order (finite values only).
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

// The k-th smallest (from 0) key of the groups `has(p)` marks, by eight 8-bit
// radix passes from the top byte; every thread of the block gets it.
template <typename Has>
__device__ unsigned long long BlockKthSmallest(int n, unsigned k, Has has, const float* entry,
                                               const float* scores, double sqrt_d,
                                               unsigned* histogram, unsigned long long* chosen,
                                               unsigned* rest) {
  unsigned long long prefix = 0, mask = 0;
  if (threadIdx.x == 0) *rest = k;
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) histogram[b] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
      if (!has(p)) continue;
      const unsigned long long key = OrderedKey64(FeedbackDiff(sqrt_d, entry[p], scores[p]));
      if ((key & mask) == prefix) atomicAdd(&histogram[(key >> shift) & 0xFF], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned below = 0, left = *rest;
      int bin = 0;
      for (; bin < 255 && below + histogram[bin] <= left; ++bin) below += histogram[bin];
      *rest = left - below;
      *chosen = static_cast<unsigned long long>(bin);
    }
    __syncthreads();
    prefix |= *chosen << shift;
    mask |= 0xFFull << shift;
    __syncthreads();  // *chosen is written again by the next pass
  }
  return prefix;
}

__global__ void __launch_bounds__(kFeedbackThreads) FeedbackKernel(Shape s, FeedbackArgs a) {
  __shared__ unsigned histogram[256];
  __shared__ unsigned long long chosen;
  __shared__ unsigned rest, count;
  const int layer = blockIdx.x / s.q_heads, h = blockIdx.x % s.q_heads, row = blockIdx.y;
  if (a.scored != nullptr && !a.scored[layer * s.q_heads + h]) return;
  const int n = GroupsOf(s, a.rows[row].context_tokens);
  const float* entry =
      a.feedback +
      ((int64_t{layer} * s.max_seqs + a.rows[row].table_row) * s.q_heads + h) * s.max_groups;
  float* scores = a.scores + ((int64_t{row} * s.layers + layer) * s.q_heads + h) * s.max_groups;
  auto has = [&](int p) { return isfinite(entry[p]) && isfinite(scores[p]); };
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  unsigned local = 0;
  for (int p = threadIdx.x; p < n; p += blockDim.x) local += has(p);
  local = __reduce_add_sync(0xFFFFFFFFu, local);
  if (threadIdx.x % 32 == 0 && local > 0) atomicAdd(&count, local);
  __syncthreads();
  const unsigned c = count;
  double offset = 0.0;
  if (c > 0) {
    // core/: the (c/2)-th smallest; for an even count, the mean with the one below.
    offset = KeyToDouble(
        BlockKthSmallest(n, c / 2, has, entry, scores, a.sqrt_d, histogram, &chosen, &rest));
    if (c % 2 == 0) {
      const double below = KeyToDouble(
          BlockKthSmallest(n, c / 2 - 1, has, entry, scores, a.sqrt_d, histogram, &chosen, &rest));
      offset = __dmul_rn(0.5, __dadd_rn(offset, below));
    }
  }
  __syncthreads();  // every thread read the scores before any is rewritten
  for (int p = threadIdx.x; p < n; p += blockDim.x) {
    const float e = entry[p];
    if (isfinite(e)) {
      scores[p] = static_cast<float>(__dmul_rn(a.sqrt_d, static_cast<double>(e)));
    } else if (isfinite(scores[p])) {
      scores[p] = static_cast<float>(__dadd_rn(static_cast<double>(scores[p]), offset));
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
  for (int p = threadIdx.x; p < n; p += blockDim.x) entry[p] = __int_as_float(0x7FC00000);
}

}  // namespace eps::gpu::kernels
