// The query terms' kernel for the common shapes (gpu/terms_kernel.cuh says what
// the terms are): d = 32·kE with kE of 2, 4 or 8, and jl's m = kM of 4, 8 or 16
// (kM = -1: ‖q‖ only, every method but jl). Lane l owns elements
// [kE·l, kE·l + kE) of every query and the same rows of Φ, which stay in its
// registers for every head of the warp's run: a head costs one vector load
// of the query, kE·kM multiply-adds and a reduce-scatter of the kM sums over the
// warp (z_j ends in the lanes l with l >> (5 − log2 kM) = j): 14.0 M warp
// instructions for 65,536 heads against TermsKernel's 37.9 M, 26.5 against
// 44.8 µs (H100, ncu, 64 × 32k, d = 128, m = 8, eighth session; the twelfth's
// ncu run under its locked clocks read 30.3 µs; docs/benchmarks/gpu.md). The
// sums run in another order than HeadTerms' (within float rounding); scoring
// blocks that build their own terms run these (WarpsHeldTerms) where they hold
// a lane's share of Φ, so a head's terms are the same at every batch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "gpu/terms_kernel.cuh"

namespace eps::gpu::kernels {

// Whether TermsKernelHeld<kM, d / 32> serves (d, m): d of 64, 128 or 256, and
// Φ's share of a lane (d / 32 · m floats) at most 64 registers. The queries
// must lie on a 16-byte boundary (the lane's vector loads).
__host__ __device__ constexpr bool TermsHeldFits(int d, int m) {
  return (d == 64 || d == 128 || d == 256) &&
         (m == -1 || ((m == 4 || m == 8 || m == 16) && d / 32 * m <= 64));
}

// Elements [at, at + kE) of the queries as float, exactly as LoadAsFloatDevice
// widens them, by one vector load (at is a multiple of kE).
template <int kE>
__device__ inline void LoadQueryPart(const void* queries, DType dtype, int64_t at, float (&x)[kE]) {
  if (dtype == DType::kFloat16 || dtype == DType::kBFloat16) {
    unsigned w[kE / 2];  // two 16-bit elements a word
    const unsigned* from = static_cast<const unsigned*>(queries) + at / 2;
    if constexpr (kE == 2) {
      w[0] = *from;
    } else if constexpr (kE == 4) {
      const uint2 v = *reinterpret_cast<const uint2*>(from);
      w[0] = v.x;
      w[1] = v.y;
    } else {
#pragma unroll
      for (int k = 0; k < kE / 2; k += 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(from + k);
        w[k] = v.x;
        w[k + 1] = v.y;
        w[k + 2] = v.z;
        w[k + 3] = v.w;
      }
    }
#pragma unroll
    for (int k = 0; k < kE / 2; ++k) {
      const unsigned short lo = w[k] & 0xFFFFu, hi = w[k] >> 16;
      if (dtype == DType::kFloat16) {
        x[2 * k] = __half2float(__ushort_as_half(lo));
        x[2 * k + 1] = __half2float(__ushort_as_half(hi));
      } else {
        x[2 * k] = __bfloat162float(__ushort_as_bfloat16(lo));
        x[2 * k + 1] = __bfloat162float(__ushort_as_bfloat16(hi));
      }
    }
  } else {
    const float* from = static_cast<const float*>(queries) + at;
    if constexpr (kE == 2) {
      const float2 v = *reinterpret_cast<const float2*>(from);
      x[0] = v.x;
      x[1] = v.y;
    } else {
#pragma unroll
      for (int k = 0; k < kE; k += 4) {
        const float4 v = *reinterpret_cast<const float4*>(from + k);
        x[k] = v.x;
        x[k + 1] = v.y;
        x[k + 2] = v.z;
        x[k + 3] = v.w;
      }
    }
  }
}

// Sums v[j] (j < kM, a power of two up to 32) over the warp's lanes: each
// halving step trades half of the remaining sums with the lane `o` apart and
// keeps the other half, so after log2 kM steps lane l holds the partial of
// j = l >> (5 − log2 kM), which the remaining steps complete. Returns z_j.
// `total` is summed over all lanes alongside (every lane gets the sum), so its
// shuffles overlap the others'.
template <int kM>
__device__ inline float WarpReduceScatter(float (&v)[kM], int lane, float& total) {
  int o = 16;
#pragma unroll
  for (int half = kM / 2; half >= 1; half /= 2, o /= 2) {
    const bool upper = (lane & o) != 0;
    total += __shfl_xor_sync(0xFFFFFFFFu, total, o);
#pragma unroll
    for (int t = 0; t < half; ++t) {
      const float send = upper ? v[t] : v[t + half];
      const float keep = upper ? v[t + half] : v[t];
      v[t] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, o);
    }
  }
  float z = v[0];
#pragma unroll
  for (int r = 16 / kM; r > 0; r /= 2) {
    total += __shfl_xor_sync(0xFFFFFFFFu, total, r);
    z += __shfl_xor_sync(0xFFFFFFFFu, z, r);
  }
  return z;
}

// A warp's share of one KV head's Φ as TermsKernelHeld holds it: lane l's rows
// [kE·l, kE·l + kE), and for each packed entry of z zᵀ the lane writes (lane +
// 32·t) the lanes whose z_i and z_j it multiplies.
template <int kM, int kE>
struct HeldPhi {
  static constexpr int kShift = kM == 16 ? 1 : kM == 8 ? 2 : 3;  // z_j's lanes: l >> kShift == j
  static constexpr int kPacked = kM > 0 ? kM*(kM + 1) / 2 : 0;
  static constexpr int kParts = kPacked > 0 ? (kPacked + 31) / 32 : 1;  // packed entries a lane
  static constexpr int kHeld = kM > 0 ? kM : 1;
  float phi[kE][kHeld];
  int from_i[kParts], from_j[kParts];

  // `matrix`: the KV head's Φ [d, m] (PhiOf); unused for kM < 0.
  __device__ void Load(const float* matrix, int lane) {
    if constexpr (kM > 0) {
      const float4* rows = reinterpret_cast<const float4*>(matrix + kE * lane * kM);
#pragma unroll
      for (int e = 0; e < kE; ++e) {
#pragma unroll
        for (int j = 0; j < kM; j += 4) {
          const float4 v = rows[(e * kM + j) / 4];
          phi[e][j] = v.x;
          phi[e][j + 1] = v.y;
          phi[e][j + 2] = v.z;
          phi[e][j + 3] = v.w;
        }
      }
#pragma unroll
      for (int t = 0; t < kParts; ++t) {
        int i = 0, j = 0;
        if (lane + 32 * t < kPacked) UnpackIndex(lane + 32 * t, kM, &i, &j);
        from_i[t] = i << kShift;
        from_j[t] = j << kShift;
      }
    }
  }
};

// Fails the step (kBadQuery) for each element of the lane's part x of query
// head h that is not finite, where the head is scored.
template <int kE>
__device__ inline void CheckQueryPart(const float (&x)[kE], const uint8_t* scored,
                                      StepReport* report, const Shape& s, int layer, int row, int h,
                                      int lane) {
  bool bad = false;
#pragma unroll
  for (int e = 0; e < kE; ++e) bad |= !isfinite(x[e]);
  if (bad && (scored == nullptr || scored[layer * s.q_heads + h])) {
    for (int e = 0; e < kE; ++e) {
      if (!isfinite(x[e])) {
        Fail(&report->status, kBadQuery, row, (layer * s.q_heads + h) * s.d + kE * lane + e, 0);
      }
    }
  }
}

// One head's terms from the lane's part x of its query and the warp's HeldPhi:
// the packed z zᵀ into out[0, packed) (jl) and ‖q‖ into out[packed], as
// TermsKernelHeld writes them; returns lane 0's Σ q² (CheckQueryNorm). Every
// lane of the warp calls it.
template <int kM, int kE>
__device__ inline float HeldHeadTerms(const HeldPhi<kM, kE>& held, const float (&x)[kE], int packed,
                                      float* out, int lane) {
  float n2 = 0.0f;
#pragma unroll
  for (int e = 0; e < kE; ++e) n2 += x[e] * x[e];
  if constexpr (kM > 0) {
    constexpr int kPacked = HeldPhi<kM, kE>::kPacked;
    float p[kM];
#pragma unroll
    for (int j = 0; j < kM; ++j) p[j] = held.phi[0][j] * x[0];
#pragma unroll
    for (int e = 1; e < kE; ++e) {
#pragma unroll
      for (int j = 0; j < kM; ++j) p[j] += held.phi[e][j] * x[e];
    }
    const float z = WarpReduceScatter<kM>(p, lane, n2);
#pragma unroll
    for (int t = 0; t < HeldPhi<kM, kE>::kParts; ++t) {
      const float zi = __shfl_sync(0xFFFFFFFFu, z, held.from_i[t]);
      const float zj = __shfl_sync(0xFFFFFFFFu, z, held.from_j[t]);
      if (lane + 32 * t < kPacked) {
        out[lane + 32 * t] = (held.from_i[t] == held.from_j[t] ? 1.0f : 2.0f) * zi * zj;
      }
    }
  } else {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) n2 += __shfl_xor_sync(0xFFFFFFFFu, n2, o);
  }
  if (lane == 0) out[packed] = sqrtf(n2);
  return n2;
}

// The terms of one (row, layer, KV head)'s query heads into `terms` [ratio,
// TermWords(m)] (a scoring block's shared memory), as TermsKernelHeld<kM, kE>
// builds them: warp w takes heads w, w + warps, ... (every warp of the block
// calls it; no barrier inside).
template <int kM, int kE>
__device__ inline void WarpsHeldTerms(const Shape& s, const void* queries, const float* phi,
                                      const uint8_t* scored, StepReport* report, int layer, int row,
                                      int kvh, float* terms, int warp, int warps, int lane) {
  const int ratio = s.q_heads / s.kv_heads, words = TermWords(s.m);
  if (warp >= ratio) return;
  HeldPhi<kM, kE> held;
  held.Load(kM > 0 ? PhiOf(s, phi, layer, kvh) : nullptr, lane);
  for (int r = warp; r < ratio; r += warps) {
    const int h = kvh * ratio + r;
    float x[kE];
    LoadQueryPart<kE>(queries, s.query_dtype,
                      ((int64_t{layer} * s.max_batch + row) * s.q_heads + h) * s.d + kE * lane, x);
    CheckQueryPart<kE>(x, scored, report, s, layer, row, h, lane);
    const float n2 = HeldHeadTerms<kM, kE>(held, x, s.record.packed, terms + r * words, lane);
    CheckQueryNorm(s, scored, report, layer, row, h, n2, lane);
  }
}

// Whether a scoring block builds its terms by WarpsHeldTerms<m, e>: Φ's share of
// a lane in at most 32 registers, and m of at most 8 (the fused kernel has 64 a
// thread, and m = 16's kernels hold a 136-word Gram: more spilled), else by
// HeadTerms.
__host__ __device__ constexpr bool BlockHoldsPhi(int e, int m) { return m <= 8 && e * m <= 32; }

// WarpsHeldTerms for kE = held_e (d / 32: 2, 4 or 8, as BlockHoldsPhi allows).
template <int kM>
__device__ inline void BlockHeldTerms(const Shape& s, const void* queries, const float* phi,
                                      const uint8_t* scored, StepReport* report, int held_e,
                                      int layer, int row, int kvh, float* terms, int warp,
                                      int lane) {
  const int warps = blockDim.x / 32;
  if constexpr (BlockHoldsPhi(2, kM)) {
    if (held_e == 2) {
      WarpsHeldTerms<kM, 2>(s, queries, phi, scored, report, layer, row, kvh, terms, warp, warps,
                            lane);
    }
  }
  if constexpr (BlockHoldsPhi(4, kM)) {
    if (held_e == 4) {
      WarpsHeldTerms<kM, 4>(s, queries, phi, scored, report, layer, row, kvh, terms, warp, warps,
                            lane);
    }
  }
  if constexpr (BlockHoldsPhi(8, kM)) {
    if (held_e == 8) {
      WarpsHeldTerms<kM, 8>(s, queries, phi, scored, report, layer, row, kvh, terms, warp, warps,
                            lane);
    }
  }
}

// Heads of one warp's run (TermsArgs::run): as few as leave no more warps than
// the GPU holds at once (`resident_warps`), so that each warp loads its Φ once
// for as many heads as it can while small batches still spread over the GPU,
// and the loads of a warp's next queries overlap the current one's sums.
// `wanted` > 0 (GpuSelectorOptions::terms_run) overrides it.
inline int TermsHeadsPerRun(int64_t heads, int64_t resident_warps, int wanted) {
  if (wanted > 0) return wanted;
  const int64_t warps = std::max<int64_t>(resident_warps, 1);
  return static_cast<int>(std::max<int64_t>(1, (heads + warps - 1) / warps));
}

// A grid of ⌈warps / 4⌉ blocks of kTermsThreads threads, no shared memory:
// warp w takes KV head w % kv_heads of layer (w / kv_heads) % layers, and of
// that KV head's (row, query head) pairs in row-major order the run
// w / (kv_heads · layers); it loads its lanes' rows of Φ once, then builds the
// terms of its run's heads, each head's query loaded two heads ahead of its
// sums.
template <int kM, int kE>
__global__ void __launch_bounds__(kTermsThreads) TermsKernelHeld(Shape s, TermsArgs a) {
  LetScoringStart();
  const int lane = threadIdx.x % 32;
  const int ratio = s.q_heads / s.kv_heads, words = TermWords(s.m);
  // 32-bit indices (the host keeps warps and heads below 2^31): a 64-bit division
  // is a software routine, a chain of ~70 instructions before the first load.
  const int w = static_cast<int>(blockIdx.x) * (kTermsThreads / 32) + threadIdx.x / 32;
  const int kvh = w % s.kv_heads, layer = w / s.kv_heads % s.layers;
  const int first = w / (s.kv_heads * s.layers) * a.run, heads = a.rows * ratio;
  if (first >= heads) return;
  const int end = min(first + a.run, heads);
  const int packed = s.record.packed;  // where ‖q‖ goes (kPacked for jl)
  HeldPhi<kM, kE> held;
  held.Load(kM > 0 ? PhiOf(s, a.phi, layer, kvh) : nullptr, lane);
  // Query head kvh · ratio + r of `row`: its first element for this lane.
  auto element = [&](int row, int r) {
    return ((int64_t{layer} * s.max_batch + row) * s.q_heads + kvh * ratio + r) * s.d + kE * lane;
  };
  // Two queries in flight ahead of the sums (one ahead: 28.9 against 26.5 µs at
  // 64 × 32k, H100).
  int row = first / ratio, r = first % ratio;
  int load_row = row, load_r = r;  // the head of the next load
  auto advance = [&](int& rw, int& rr) {
    if (++rr == ratio) {
      rr = 0;
      ++rw;
    }
  };
  float x[kE], next[kE] = {};
  LoadQueryPart<kE>(a.queries, s.query_dtype, element(load_row, load_r), x);
  advance(load_row, load_r);
  if (first + 1 < end) LoadQueryPart<kE>(a.queries, s.query_dtype, element(load_row, load_r), next);
  advance(load_row, load_r);
  for (int i = first; i < end; ++i) {
    const int h = kvh * ratio + r, this_row = row;
    advance(row, r);
    float after[kE] = {};
    if (i + 2 < end) LoadQueryPart<kE>(a.queries, s.query_dtype, element(load_row, load_r), after);
    advance(load_row, load_r);
    CheckQueryPart<kE>(x, a.scored, a.report, s, layer, this_row, h, lane);
    const float n2 = HeldHeadTerms<kM, kE>(
        held, x, packed, a.terms + ((int64_t{this_row} * s.layers + layer) * s.q_heads + h) * words,
        lane);
    CheckQueryNorm(s, a.scored, a.report, layer, this_row, h, n2, lane);
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      x[e] = next[e];
      next[e] = after[e];
    }
  }
}

}  // namespace eps::gpu::kernels
