// The query terms of the GPU pre-pass (gpu/step.h), built once per (row, layer,
// query head): ‖q‖, and for jl z = Φᵀq and the packed z zᵀ with doubled
// off-diagonal (core QueryTerms), by one warp per head (HeadTerms). Usually the
// step's first kernel builds them all (TermsKernelHeld where d and m allow,
// else TermsKernel) and every scoring block of
// the (row, layer, KV head) reads them from L2 (gpu/score_kernel.cuh), starting
// with its record loads; when the whole scoring grid is resident at once (jl's
// staged path, one block per row, layer and KV head: batch 1 at 32k), each
// scoring block builds its own heads' instead while its records load, and the
// step has no terms kernel. Building them in every block at every batch lost:
// each later wave then waits for its own terms
// (docs/benchmarks/gpu-history-2026-11-26-sessions-3-7.md, seventh session).
// Also the step's query check: a non-finite element of a scored head fails it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/phi.cuh"
#include "gpu/step_shape.cuh"

namespace eps::gpu::kernels {

inline constexpr int kTermsThreads = 128;

// The scoring kernel is launched as this kernel's programmatic dependent
// (gpu/step_launch.cuh): once every block of this one has started, scoring
// blocks may start too, read their slots and queue their record loads, and
// wait in WaitForQueryTerms until this kernel has finished and its writes are
// visible. Launched without that attribute, both are no-ops.
__device__ inline void LetScoringStart() { asm volatile("griddepcontrol.launch_dependents;"); }
__device__ inline void WaitForQueryTerms() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Words of one head's terms: packed z zᵀ [m(m+1)/2], then ‖q‖, padded to 16 bytes.
__host__ __device__ constexpr int TermWords(int m) { return (m * (m + 1) / 2 + 1 + 3) / 4 * 4; }

struct TermsArgs {
  const void* queries;    // [layers, max_batch, q_heads, d]
  const float* phi;       // [layers, kv_heads, d, m]
  const uint8_t* scored;  // [layers, q_heads] or null (every head scored)
  float* terms;           // [max_batch, layers, q_heads, TermWords(m)]
  StepReport* report;
  // TermsKernelHeld: the step's batch, and the (row, query head) pairs of one warp's run.
  int rows, run;
};

// Dynamic shared memory of TermsKernel: a query and its z per warp
// (TermsKernelHeld takes none).
__host__ __device__ inline size_t TermsSharedWords(int d, int m) {
  return static_cast<size_t>(kTermsThreads / 32) * (d + m);
}

// z_j = Σ_i Φ[i][j] q_i for j < m, any m: lane l sums i = l, l + 32, ... in
// order and shuffles reduce, one j at a time; lane 0 writes z (shared).
__device__ inline void ProjectQuery(const float* matrix, const float* q, int d, int m, int lane,
                                    float* z) {
  for (int j = 0; j < m; ++j) {
    float partial = 0.0f;
    for (int i = lane; i < d; i += 32) partial += matrix[i * m + j] * q[i];
    for (int o = 16; o > 0; o /= 2) partial += __shfl_xor_sync(0xFFFFFFFFu, partial, o);
    if (lane == 0) z[j] = partial;
  }
}

// The same with m known (a multiple of 4, at most 32): lane l takes the
// float4 `l % (m/4)` of rows l / (m/4), l / (m/4) + 32/(m/4), ... of Φ (one
// load instruction reads 32 / (m/4) whole rows, consecutive), and shuffles
// across the lanes of the same float4 finish the sums; lanes 0 .. m/4 − 1
// write z (shared).
template <int kM>
__device__ inline void ProjectQueryRows(const float* matrix, const float* q, int d, int lane,
                                        float* z) {
  static_assert(kM % 4 == 0 && kM <= 32, "whole float4s of a row of Φ");
  constexpr int kQuads = kM / 4, kRows = 32 / kQuads;
  const int quad = lane % kQuads;
  float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f, p3 = 0.0f;
  const float4* at = reinterpret_cast<const float4*>(matrix) + lane;  // row lane / kQuads
#pragma unroll 4
  for (int i = lane / kQuads; i < d; i += kRows, at += 32) {
    const float4 v = *at;
    const float qi = q[i];
    p0 += v.x * qi;
    p1 += v.y * qi;
    p2 += v.z * qi;
    p3 += v.w * qi;
  }
#pragma unroll
  for (int o = kQuads; o < 32; o *= 2) {
    p0 += __shfl_xor_sync(0xFFFFFFFFu, p0, o);
    p1 += __shfl_xor_sync(0xFFFFFFFFu, p1, o);
    p2 += __shfl_xor_sync(0xFFFFFFFFu, p2, o);
    p3 += __shfl_xor_sync(0xFFFFFFFFu, p3, o);
  }
  if (lane < kQuads) {
    z[4 * quad] = p0;
    z[4 * quad + 1] = p1;
    z[4 * quad + 2] = p2;
    z[4 * quad + 3] = p3;
  }
}

// Packed index e of the upper triangle of an m × m matrix (row-major, i ≤ j)
// -> (i, j), as core/layout.h's PackedIndex inverts.
__device__ inline void UnpackIndex(int e, int m, int* i_out, int* j_out) {
  int p = e, i = 0;
  while (p >= m - i) {
    p -= m - i;
    ++i;
  }
  *i_out = i;
  *j_out = i + p;
}

// The KV head's Φ [d, m] of `layer`, as the terms kernels read it.
__device__ inline const float* PhiOf(const Shape& s, const float* phi, int layer, int kvh) {
  return phi + (int64_t{layer} * s.kv_heads + kvh) * s.d * s.m;
}

// Fails the step (kQueryOverflow) when a scored head's Σ q_j² reaches core
// kMaxQueryNorm2: `n2` is lane 0's float sum of the squares (the ‖q‖² the scores
// use), compared as it is (core/bounds.h says where that may differ from core/'s
// double sum: only within its rounding of the bound).
__device__ inline void CheckQueryNorm(const Shape& s, const uint8_t* scored, StepReport* report,
                                      int layer, int row, int h, float n2, int lane) {
  if (lane != 0 || n2 < kMaxQueryNorm2) return;
  if (scored != nullptr && !scored[layer * s.q_heads + h]) return;
  Fail(&report->status, kQueryOverflow, row, layer * s.q_heads + h, s.q_heads);
}

// One query head's terms, by one warp: its query loaded (and checked where the
// head is scored), ‖q‖ into out[packed], and for jl (kM >= 0) the packed z zᵀ
// into out[0, packed) from `matrix`, the head's KV head's Φ [d, m] (PhiOf;
// unused for kM < 0). `q` [d] and `z` [m] are the warp's scratch in shared
// memory; `out` [TermWords(m)] lies in global memory (TermsKernel) or in the
// scoring block's shared memory (ScoreGroups with the terms in the block).
// kM < 0: ‖q‖ only (every method but jl); 0: jl, m from the shape
// (ProjectQuery); 4, 8, 16: jl with m known (ProjectQueryRows).
template <int kM>
__device__ inline void HeadTerms(const Shape& s, const void* queries, const float* matrix,
                                 const uint8_t* scored_heads, StepReport* report, int layer,
                                 int row, int h, float* q, float* z, float* out, int lane) {
  const int packed = s.record.packed;
  const bool scored = scored_heads == nullptr || scored_heads[layer * s.q_heads + h];
  const int64_t at = ((int64_t{layer} * s.max_batch + row) * s.q_heads + h) * s.d;
  // Four elements per lane loaded before any is checked, so the loads are in flight together.
  for (int i0 = 0; i0 < s.d; i0 += 128) {
    float x[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = i0 + 32 * k + lane;
      x[k] = i < s.d ? LoadAsFloatDevice(queries, s.query_dtype, at + i) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int i = i0 + 32 * k + lane;
      if (i >= s.d) break;
      q[i] = x[k];
      if (scored && !isfinite(x[k])) {
        Fail(&report->status, kBadQuery, row, (layer * s.q_heads + h) * s.d + i, 0);
      }
    }
  }
  __syncwarp();
  float n2 = 0.0f;
  for (int i = lane; i < s.d; i += 32) n2 += q[i] * q[i];
  for (int o = 16; o > 0; o /= 2) n2 += __shfl_xor_sync(0xFFFFFFFFu, n2, o);
  if (lane == 0) out[packed] = sqrtf(n2);
  CheckQueryNorm(s, scored_heads, report, layer, row, h, n2, lane);
  if constexpr (kM >= 0) {
    if constexpr (kM > 0) {
      ProjectQueryRows<kM>(matrix, q, s.d, lane, z);
    } else {
      ProjectQuery(matrix, q, s.d, s.m, lane, z);
    }
    __syncwarp();
    const int m = kM > 0 ? kM : s.m;
    for (int e = lane; e < packed; e += 32) {
      int i, j;
      UnpackIndex(e, m, &i, &j);
      out[e] = (i == j ? 1.0f : 2.0f) * z[i] * z[j];
    }
  }
  __syncwarp();  // the warp's next head overwrites q and z
}

// Grid (kv_heads, layers, rows), kTermsThreads threads: a warp per query head
// of the KV head (HeadTerms). Any d and m; TermsKernelHeld (terms_held.cuh)
// serves the common shapes.
template <int kM>
__global__ void __launch_bounds__(kTermsThreads) TermsKernel(Shape s, TermsArgs a) {
  LetScoringStart();
  extern __shared__ float shared[];
  const int kvh = blockIdx.x, layer = blockIdx.y, row = blockIdx.z;
  const int ratio = s.q_heads / s.kv_heads, words = TermWords(s.m);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* q = shared + warp * (s.d + s.m);  // [d]
  float* z = q + s.d;                      // [m]
  for (int r = warp; r < ratio; r += kTermsThreads / 32) {
    const int h = kvh * ratio + r;
    HeadTerms<kM>(s, a.queries, kM >= 0 ? PhiOf(s, a.phi, layer, kvh) : nullptr, a.scored, a.report,
                  layer, row, h, q, z,
                  a.terms + ((int64_t{row} * s.layers + layer) * s.q_heads + h) * words, lane);
  }
}

}  // namespace eps::gpu::kernels
