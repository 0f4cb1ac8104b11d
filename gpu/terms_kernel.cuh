// The query terms of the GPU pre-pass (gpu/step.h), built once per (row, layer,
// query head) by the step's first kernel: ‖q‖, and for jl z = Φᵀq and the
// packed z zᵀ with doubled off-diagonal (core QueryTerms). Every scoring block
// of the (row, layer, KV head) then reads them from L2 (gpu/score_kernel.cuh)
// and starts with its record loads, where it used to build them itself first
// (at batch 64 × 32k, 16,384 blocks each computing Φᵀq before its first load).
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
};

// Dynamic shared memory of TermsKernel: a query and its z per warp.
__host__ __device__ inline size_t TermsSharedWords(int d, int m) {
  return static_cast<size_t>(kTermsThreads / 32) * (d + m);
}

// z_j = Σ_i Φ[i][j] q_i for j < m: lane l sums i = l, l + 32, ... in order
// and shuffles reduce, as the scoring blocks summed (the same bits). With m
// known (kM > 0) each lane reads whole rows of Φ, 16 bytes at a time, for
// every j at once, so all its loads are in flight together; otherwise one j
// at a time.
template <int kM>
__device__ inline void ProjectQuery(const float* matrix, const float* q, int d, int m, int lane,
                                    float* z) {
  if constexpr (kM > 0) {
    float partial[kM] = {};
#pragma unroll 4
    for (int i = lane; i < d; i += 32) {
      const float qi = q[i];
#pragma unroll
      for (int v = 0; v < kM / 4; ++v) {
        const float4 row = reinterpret_cast<const float4*>(matrix + i * kM)[v];
        partial[4 * v] += row.x * qi;
        partial[4 * v + 1] += row.y * qi;
        partial[4 * v + 2] += row.z * qi;
        partial[4 * v + 3] += row.w * qi;
      }
    }
#pragma unroll
    for (int j = 0; j < kM; ++j) {
      for (int o = 16; o > 0; o /= 2) partial[j] += __shfl_xor_sync(0xFFFFFFFFu, partial[j], o);
      if (lane == 0) z[j] = partial[j];
    }
  } else {
    for (int j = 0; j < m; ++j) {
      float partial = 0.0f;
      for (int i = lane; i < d; i += 32) partial += matrix[i * m + j] * q[i];
      for (int o = 16; o > 0; o /= 2) partial += __shfl_xor_sync(0xFFFFFFFFu, partial, o);
      if (lane == 0) z[j] = partial;
    }
  }
}

// Grid (layers * kv_heads, rows), kTermsThreads threads: a warp per query head
// of the KV head. kM < 0: ‖q‖ only (every method but jl); 0: jl, m from the
// shape; 4, 8, 16: jl with m known (ProjectQuery).
template <int kM>
__global__ void __launch_bounds__(kTermsThreads) TermsKernel(Shape s, TermsArgs a) {
  LetScoringStart();
  extern __shared__ float shared[];
  const int row = blockIdx.y;
  const int layer = blockIdx.x / s.kv_heads, kvh = blockIdx.x % s.kv_heads;
  const int ratio = s.q_heads / s.kv_heads, packed = s.record.packed, words = TermWords(s.m);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* q = shared + warp * (s.d + s.m);  // [d]
  float* z = q + s.d;                      // [m]
  const float* matrix = a.phi + (int64_t{layer} * s.kv_heads + kvh) * s.d * s.m;
  for (int r = warp; r < ratio; r += kTermsThreads / 32) {
    const int h = kvh * ratio + r;
    const bool scored = a.scored == nullptr || a.scored[layer * s.q_heads + h];
    const int64_t at = ((int64_t{layer} * s.max_batch + row) * s.q_heads + h) * s.d;
    // Four elements per lane loaded before any is checked, so the loads are in flight together.
    for (int i0 = 0; i0 < s.d; i0 += 128) {
      float x[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = i0 + 32 * k + lane;
        x[k] = i < s.d ? LoadAsFloatDevice(a.queries, s.query_dtype, at + i) : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int i = i0 + 32 * k + lane;
        if (i >= s.d) break;
        q[i] = x[k];
        if (scored && !isfinite(x[k])) {
          Fail(&a.report->status, kBadQuery, row, (layer * s.q_heads + h) * s.d + i, 0);
        }
      }
    }
    __syncwarp();
    float* out = a.terms + ((int64_t{row} * s.layers + layer) * s.q_heads + h) * words;
    float n2 = 0.0f;
    for (int i = lane; i < s.d; i += 32) n2 += q[i] * q[i];
    for (int o = 16; o > 0; o /= 2) n2 += __shfl_xor_sync(0xFFFFFFFFu, n2, o);
    if (lane == 0) out[packed] = sqrtf(n2);
    if constexpr (kM >= 0) {
      ProjectQuery<kM>(matrix, q, s.d, s.m, lane, z);
      __syncwarp();
      for (int e = lane; e < packed; e += 32) {
        int p = e, i = 0;
        while (p >= s.m - i) {  // packed index -> (i, j), i ≤ j
          p -= s.m - i;
          ++i;
        }
        const int j = i + p;
        out[e] = (i == j ? 1.0f : 2.0f) * z[i] * z[j];
      }
    }
    __syncwarp();  // the warp's next head overwrites q and z
  }
}

}  // namespace eps::gpu::kernels
