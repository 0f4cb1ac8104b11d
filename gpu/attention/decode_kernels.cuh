// The device half of sparse paged decode attention (paged_attention.h): flash-decoding
// over block lists. Included only by paged_attention.cu, which plans and launches.
//
// A unit is one (row, KV head, head group, split): up to GT query heads of one KV head,
// so K and V are read once for all of them, over one split's run of list entries.
// Splits > 1 write float partials (output normalised by its own sum, and its
// log2-sum-exp) that CombineKernel merges. A unit is a CTA (its warps take tiles of TT
// tokens round-robin) or a warp (KernelVariant). A lane holds 8 consecutive elements
// (one 16-byte load) of one token's K and V row, LPT = D/8 lanes cover a row, TP =
// 32/LPT tokens per pass, PT passes per tile, all loads of a tile issued before the
// first use. Scores live in the log2 domain (q is prescaled by softmax_scale *
// log2(e)), so exp2 is one instruction.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gpu/attention/paged_attention.h"
#include "gpu/attention/row_list.h"

namespace eps::attention {

constexpr int kWarps = 4;  // warps per CTA
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// How work units map onto the GPU (docs/benchmarks/attention.md compares them). The
// default picks per call between kCtaKvInner (work too small to fill the GPU with one
// warp per unit) and a warp-per-unit kernel; the private environment variable
// EPS_ATTN_VARIANT fixes one, so that one benchmark run compares them.
enum class KernelVariant : int32_t {
  kCtaSplitInner,  // one CTA per unit, a row's splits adjacent in the grid
  kCtaKvInner,     // one CTA per unit, a row's KV heads adjacent in the grid
  kWarpLean,       // one warp per unit, a CTA's warps on adjacent KV heads; 16 warps/SM
  kWarpPipe,       // as kWarpLean, two tiles in flight per warp; 12 warps/SM
  kWarpMma         // as kWarpLean, q·Kᵀ and P·V on tensor cores (decode_mma.cuh)
};

// Launch shape, computed on the host in one place (MakePlan()). A unit is one
// (row, KV head, head group, split); units are numbered with the KV head fastest
// (except kCtaSplitInner: split fastest), so the units that read the same blocks of a
// union list run at the same time and together read each block's rows contiguously.
struct Plan {
  KernelVariant variant = KernelVariant::kWarpLean;
  int gt = 1;           // query heads per unit (template parameter): 1, 2, 4 or 8
  int head_groups = 1;  // units per (row, KV head) along the query heads
  int splits = 1;       // units per (row, KV head, head group) along the list
  int min_chunk = 1;    // a split covers max(min_chunk, ceil(count / splits)) entries
  uint64_t workspace_bytes = 0;
  uint64_t lse_offset = 0;  // bytes: where the partial lse start in the workspace
};

__device__ __forceinline__ uint4 LoadStreaming(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

template <typename T>
__device__ __forceinline__ void ToFloat8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = h.x;
      f[2 * i + 1] = h.y;
    }
  }
}

template <typename T>
__device__ __forceinline__ T FromFloat(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return __float2half_rn(x);
  }
}

__device__ __forceinline__ void RecordError(int32_t* word, int32_t code, int64_t row,
                                            int64_t kv_head, int32_t value) {
  if (word != nullptr && atomicCAS(word, 0, code) == 0) {
    word[1] = static_cast<int32_t>(row);
    word[2] = static_cast<int32_t>(kv_head);
    word[3] = value;
  }
}

// Combines `x` (a group's partial log-sum-exp) into a feedback entry: NaN (no value
// yet) takes x, a finite value becomes log(e^old + e^x). A CAS loop, so the blocks of one
// group may arrive from any unit in any order.
__device__ __forceinline__ void AtomicLogAddExp(float* entry, float x) {
  unsigned int* word = reinterpret_cast<unsigned int*>(entry);
  unsigned int seen = *reinterpret_cast<volatile unsigned int*>(word);
  while (true) {
    const float old = __uint_as_float(seen);
    const float hi = fmaxf(old, x);
    const float sum = isnan(old) ? x : hi + log1pf(expf(fminf(old, x) - hi));
    const unsigned int prior = atomicCAS(word, seen, __float_as_uint(sum));
    if (prior == seen) return;
    seen = prior;
  }
}

// Writes a zero output and lse -inf for heads [qh0, qh0 + n) of `row`: the result of a
// row whose list was refused (NaN-free, and recognisable through lse). Threads
// first, first + stride, ... of the caller's CTA or warp share the work.
template <typename T>
__device__ void WriteEmpty(const EpsAttnParams& p, int64_t row, int qh0, int n, int d, int first,
                           int stride) {
  for (int i = first; i < n * d; i += stride) {
    const int64_t qh = qh0 + i / d;
    T* out = static_cast<T*>(p.out) + row * p.out_stride_row + qh * p.out_stride_head;
    out[i % d] = FromFloat<T>(0.0f);
    if (p.lse != nullptr && i % d == 0) {
      p.lse[row * p.lse_stride_row + qh * p.lse_stride_head] = -INFINITY;
    }
  }
}

// List entries per split of a row with `count` entries: the split count is fixed by
// the grid (from the list width), the chunk follows the count read on the device, so a
// short list in a wide buffer still spreads over every split. SplitKernel and
// CombineKernel both use this, so they agree on which splits have work.
__device__ __forceinline__ int SplitChunk(const Plan& plan, int count) {
  return max(plan.min_chunk, (count + plan.splits - 1) / plan.splits);
}

// CTAs per SM the register budget is set for, up to 4 query heads per unit: 3 (at most
// 168 registers, 12 warps) for 8 tiles' passes in registers, 4 (at most 128, 16 warps)
// for kLean's 4 passes; kPipe holds two lean tiles, so 3 again.
template <bool kLean, bool kPipe, int GT>
constexpr int MinCtasPerSm() {
  return GT > 4 ? 1 : kLean && !kPipe ? 4 : 3;
}

// kWarpUnit: each warp is a unit (the CTA's warps take consecutive units); else the
// CTA is one unit and its warps take the unit's tiles round-robin. kLean: tiles of 4
// passes instead of 8. kPipe: the next tile's loads are issued before this one is used.
template <typename T, int D, int GT, bool kWarpUnit, bool kLean, bool kPipe>
__global__ void __launch_bounds__(kThreads, (MinCtasPerSm<kLean, kPipe, GT>()))
    SplitKernel(const __grid_constant__ EpsAttnParams p, const Plan plan) {
  constexpr int kLpt = D / 8;                               // lanes per token row
  constexpr int kTp = 32 / kLpt;                            // tokens per pass
  constexpr int kPt = (GT <= 4 ? 8 : 4) / (kLean ? 2 : 1);  // passes per tile
  constexpr int kTt = kPt * kTp;                            // tokens per tile
  constexpr int kIdsPerTile = kTt > 16 ? kTt / 16 : 1;
  constexpr int kTileWarps = kWarpUnit ? 1 : kWarps;  // warps sharing a unit's tiles

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  // unit = ((row * head_groups + head_group) * splits + split) * kv_heads + kv_head,
  // or, for kCtaSplitInner, ((row * kv_heads + kv_head) * head_groups + head_group) *
  // splits + split.
  int64_t index = kWarpUnit ? int64_t{blockIdx.x} * kWarps + warp : int64_t{blockIdx.x};
  int split;
  int head_group;
  int kv_head;
  if (plan.variant == KernelVariant::kCtaSplitInner) {
    split = static_cast<int>(index % plan.splits);
    index /= plan.splits;
    head_group = static_cast<int>(index % plan.head_groups);
    index /= plan.head_groups;
    kv_head = static_cast<int>(index % p.num_kv_heads);
    index /= p.num_kv_heads;
  } else {
    kv_head = static_cast<int>(index % p.num_kv_heads);
    index /= p.num_kv_heads;
    split = static_cast<int>(index % plan.splits);
    index /= plan.splits;
    head_group = static_cast<int>(index % plan.head_groups);
    index /= plan.head_groups;
  }
  const int64_t row = index;
  if (kWarpUnit && row >= p.batch) return;  // the last CTA's spare warps
  const int group = p.num_q_heads / p.num_kv_heads;
  const int qh0 = kv_head * group + head_group * GT;   // first query head of this unit
  const int heads = min(GT, group - head_group * GT);  // valid heads of this unit

  const RowList list = ResolveRow(p, row, kv_head);
  if (list.error != kListOk) {
    if (split == 0 && head_group == 0 && (kWarpUnit ? lane : threadIdx.x) == 0) {
      RecordError(p.error_word, list.error, row, kv_head, list.value);
    }
    if (plan.splits == 1) {
      WriteEmpty<T>(p, row, qh0, heads, D, kWarpUnit ? lane : threadIdx.x,
                    kWarpUnit ? 32 : kThreads);
    }
    return;  // with splits, CombineKernel writes the empty result
  }
  const int chunk = SplitChunk(plan, list.count);
  const int first_entry = split * chunk;
  if (first_entry >= list.count) return;  // CombineKernel reads only the active splits
  const int t_begin = first_entry * 16;
  const int t_end = min(min(list.count, first_entry + chunk) * 16, list.tokens);
  const int tile_warp = kWarpUnit ? 0 : warp;
  const int sub = lane % kLpt;  // this lane's 8 elements: [sub*8, sub*8 + 8)
  const int token_in_pass = lane / kLpt;

  // q of this lane's slice, prescaled so that scores come out in the log2 domain (or,
  // with a soft-cap, as score / softcap for the tanh).
  const float q_scale = p.softcap > 0.0f ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e;
  const float cap_scale = p.softcap * kLog2e;
  float q[GT][8];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    const int qh = qh0 + min(g, heads - 1);
    const T* q_row = static_cast<const T*>(p.q) + row * p.q_stride_row + qh * p.q_stride_head;
    ToFloat8<T>(*reinterpret_cast<const uint4*>(q_row + sub * 8), q[g]);
#pragma unroll
    for (int e = 0; e < 8; ++e) q[g][e] *= q_scale;
  }

  const char* k_base = static_cast<const char*>(p.k_cache) +
                       (kv_head * p.kv_stride_head + sub * 8) * int64_t{sizeof(T)};
  const char* v_base = static_cast<const char*>(p.v_cache) +
                       (kv_head * p.kv_stride_head + sub * 8) * int64_t{sizeof(T)};
  const int64_t block_bytes = p.kv_stride_block * int64_t{sizeof(T)};
  const int64_t token_bytes = p.kv_stride_token * int64_t{sizeof(T)};

  float m[GT];       // running max (log2 domain), the same in every lane of the warp
  float l[GT];       // running sum over this lane's tokens
  float acc[GT][8];  // running output over this lane's tokens (scaled by 2^-m)
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
  }

  // Block ids are loaded one tile ahead, so that a tile's K/V loads never wait on them.
  auto load_ids = [&](int tile, int32_t(&ids)[kIdsPerTile]) {
#pragma unroll
    for (int i = 0; i < kIdsPerTile; ++i) {
      const int entry = tile / 16 + i;
      ids[i] = tile < t_end && entry < list.count ? __ldg(list.blocks + entry) : 0;
    }
  };
  // Issues the K/V loads of `tile` (its block ids checked before any address is formed).
  auto issue = [&](int tile, const int32_t(&ids)[kIdsPerTile], uint4(&kv)[2][kPt],
                   bool(&valid)[kPt]) {
    bool id_ok[kIdsPerTile];
#pragma unroll
    for (int i = 0; i < kIdsPerTile; ++i) {
      const int entry = tile / 16 + i;
      id_ok[i] = ids[i] >= 0 && ids[i] < p.num_blocks;
      if (!id_ok[i] && tile < t_end && entry < list.count && lane == 0) {
        RecordError(p.error_word, kListBlockId, row, kv_head, ids[i]);
      }
    }
#pragma unroll
    for (int pass = 0; pass < kPt; ++pass) {
      const int t = tile + pass * kTp + token_in_pass;
      const int id_slot = kTt > 16 ? (pass * kTp) / 16 : 0;
      valid[pass] = t < t_end && id_ok[id_slot];
      if (valid[pass]) {
        const int64_t offset = ids[id_slot] * block_bytes + (t % 16) * token_bytes;
        kv[0][pass] = LoadStreaming(k_base + offset);
        kv[1][pass] = LoadStreaming(v_base + offset);
      } else {
        kv[0][pass] = make_uint4(0, 0, 0, 0);
        kv[1][pass] = make_uint4(0, 0, 0, 0);
      }
    }
  };
  // Folds a loaded tile into m, l and acc (online softmax).
  auto consume = [&](const uint4(&kv)[2][kPt], const bool(&valid)[kPt]) {
    // Scores: this lane's partial dot products, summed over the kLpt lanes of a row.
    float s[kPt][GT];
#pragma unroll
    for (int pass = 0; pass < kPt; ++pass) {
      float k[8];
      ToFloat8<T>(kv[0][pass], k);
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(q[g][e], k[e], dot);
#pragma unroll
        for (int o = kLpt / 2; o >= 1; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        if (p.softcap > 0.0f) dot = cap_scale * tanhf(dot);
        s[pass][g] = valid[pass] ? dot : -INFINITY;
      }
    }
    // Online softmax over the tile: the max across passes, then across the token
    // groups of the warp, so that m stays warp-uniform (and so does the branch below,
    // which skips the rescale when the tile does not raise the max).
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float tile_max = s[0][g];
#pragma unroll
      for (int pass = 1; pass < kPt; ++pass) tile_max = fmaxf(tile_max, s[pass][g]);
#pragma unroll
      for (int o = kLpt; o < 32; o *= 2) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
      }
      if (tile_max > m[g]) {
        const float factor = exp2f(m[g] - tile_max);  // 0 while m is -inf
        m[g] = tile_max;
        l[g] *= factor;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] *= factor;
      }
      const float m_use = m[g] == -INFINITY ? 0.0f : m[g];  // a tile of bad ids only
#pragma unroll
      for (int pass = 0; pass < kPt; ++pass) s[pass][g] = exp2f(s[pass][g] - m_use);
    }
#pragma unroll
    for (int pass = 0; pass < kPt; ++pass) {
      float v[8];
      ToFloat8<T>(kv[1][pass], v);
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        l[g] += s[pass][g];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(s[pass][g], v[e], acc[g][e]);
      }
    }
  };

  constexpr int kStride = kTileWarps * kTt;  // tokens between a warp's tiles
  const int first_tile = t_begin + tile_warp * kTt;
  if constexpr (!kPipe) {
    int32_t next_ids[kIdsPerTile];
    load_ids(first_tile, next_ids);
    for (int tile = first_tile; tile < t_end; tile += kStride) {
      int32_t ids[kIdsPerTile];
#pragma unroll
      for (int i = 0; i < kIdsPerTile; ++i) ids[i] = next_ids[i];
      load_ids(tile + kStride, next_ids);
      uint4 kv[2][kPt];
      bool valid[kPt];
      issue(tile, ids, kv, valid);
      consume(kv, valid);
    }
  } else {
    // Two tiles in registers: the next tile's loads are in flight while this one is
    // folded in, so a warp keeps bytes in flight through its compute.
    int32_t ids_a[kIdsPerTile];
    int32_t ids_b[kIdsPerTile];
    uint4 kv_a[2][kPt];
    uint4 kv_b[2][kPt];
    bool valid_a[kPt];
    bool valid_b[kPt];
    load_ids(first_tile, ids_a);
    load_ids(first_tile + kStride, ids_b);
    issue(first_tile, ids_a, kv_a, valid_a);
    for (int tile = first_tile; tile < t_end; tile += 2 * kStride) {
      load_ids(tile + 2 * kStride, ids_a);
      issue(tile + kStride, ids_b, kv_b, valid_b);
      consume(kv_a, valid_a);
      if (tile + kStride >= t_end) break;
      load_ids(tile + 3 * kStride, ids_b);
      issue(tile + 2 * kStride, ids_a, kv_a, valid_a);
      consume(kv_b, valid_b);
    }
  }

  // Sum over the warp's token groups: lanes [0, kLpt) then hold the warp's result.
#pragma unroll
  for (int g = 0; g < GT; ++g) {
#pragma unroll
    for (int o = kLpt; o < 32; o *= 2) {
      l[g] += __shfl_xor_sync(0xffffffffu, l[g], o);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] += __shfl_xor_sync(0xffffffffu, acc[g][e], o);
    }
  }
  const int64_t slot0 = (row * p.num_q_heads + qh0) * plan.splits + split;
  float* partial_out = static_cast<float*>(p.workspace);
  float* partial_lse = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + plan.lse_offset);
  if constexpr (kWarpUnit) {  // the warp holds the unit's result: lanes [0, kLpt) write it
    if (lane >= kLpt) return;
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      if (g >= heads) break;
      const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
      // log2-sum-exp of this split; -inf when every id was bad
      const float lse2 = l[g] > 0.0f ? m[g] + log2f(l[g]) : -INFINITY;
      const int64_t qh = qh0 + g;
      if (plan.splits == 1) {
        T* out = static_cast<T*>(p.out) + row * p.out_stride_row + qh * p.out_stride_head;
#pragma unroll
        for (int e = 0; e < 8; ++e) out[sub * 8 + e] = FromFloat<T>(acc[g][e] * inv);
        if (p.lse != nullptr && sub == 0) {
          p.lse[row * p.lse_stride_row + qh * p.lse_stride_head] = lse2 * kLn2;
        }
      } else {
        // partial_out [batch, num_q_heads, splits, D], partial_lse [batch, num_q_heads, splits]
        const int64_t slot = slot0 + int64_t{g} * plan.splits;
        float4* dst = reinterpret_cast<float4*>(partial_out + slot * D + sub * 8);
        dst[0] = make_float4(acc[g][0] * inv, acc[g][1] * inv, acc[g][2] * inv, acc[g][3] * inv);
        dst[1] = make_float4(acc[g][4] * inv, acc[g][5] * inv, acc[g][6] * inv, acc[g][7] * inv);
        if (sub == 0) partial_lse[slot] = lse2;
      }
    }
  } else {  // across warps through shared memory
    __shared__ float warp_m[kWarps][GT];
    __shared__ float warp_l[kWarps][GT];
    __shared__ float warp_acc[kWarps][GT][D];
    if (lane < kLpt) {
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        if (sub == 0) {
          warp_m[warp][g] = m[g];
          warp_l[warp][g] = l[g];
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) warp_acc[warp][g][sub * 8 + e] = acc[g][e];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < heads * D; i += kThreads) {
      const int g = i / D;
      const int e = i % D;
      float m_all = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, warp_m[w][g]);
      const float m_use = m_all == -INFINITY ? 0.0f : m_all;
      float sum = 0.0f;
      float o = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = exp2f(warp_m[w][g] - m_use);
        sum += warp_l[w][g] * weight;
        o += warp_acc[w][g][e] * weight;
      }
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      // log2-sum-exp of this split; -inf when every id was bad
      const float lse2 = sum > 0.0f ? m_use + log2f(sum) : -INFINITY;
      const int64_t qh = qh0 + g;
      if (plan.splits == 1) {
        T* out = static_cast<T*>(p.out) + row * p.out_stride_row + qh * p.out_stride_head;
        out[e] = FromFloat<T>(o * inv);
        if (p.lse != nullptr && e == 0) {
          p.lse[row * p.lse_stride_row + qh * p.lse_stride_head] = lse2 * kLn2;
        }
      } else {
        const int64_t slot = slot0 + int64_t{g} * plan.splits;
        partial_out[slot * D + e] = o * inv;
        if (e == 0) partial_lse[slot] = lse2;
      }
    }
  }
}

// Merges the active splits of one (row, query head): one CTA of D threads.
template <typename T, int D>
__global__ void __launch_bounds__(D)
    CombineKernel(const __grid_constant__ EpsAttnParams p, const Plan plan) {
  const int64_t row = blockIdx.x / p.num_q_heads;
  const int qh = blockIdx.x % p.num_q_heads;
  const int kv_head = qh / (p.num_q_heads / p.num_kv_heads);
  const RowList list = ResolveRow(p, row, kv_head);
  if (list.error != kListOk) {
    WriteEmpty<T>(p, row, qh, 1, D, threadIdx.x, D);
    return;
  }
  const int chunk = SplitChunk(plan, list.count);
  const int active = (list.count + chunk - 1) / chunk;
  const int64_t slot0 = (row * p.num_q_heads + qh) * plan.splits;
  const float* partial_out = static_cast<const float*>(p.workspace) + slot0 * D;
  const float* partial_lse =
      reinterpret_cast<const float*>(static_cast<const char*>(p.workspace) + plan.lse_offset) +
      slot0;
  float m_all = -INFINITY;
  for (int s = 0; s < active; ++s) m_all = fmaxf(m_all, partial_lse[s]);
  const float m_use = m_all == -INFINITY ? 0.0f : m_all;
  float sum = 0.0f;
  float o = 0.0f;
  const int e = threadIdx.x;
  for (int s = 0; s < active; ++s) {
    const float weight = exp2f(partial_lse[s] - m_use);
    sum += weight;
    o += weight * partial_out[s * D + e];
  }
  T* out = static_cast<T*>(p.out) + row * p.out_stride_row + qh * p.out_stride_head;
  out[e] = FromFloat<T>(sum > 0.0f ? o / sum : 0.0f);
  if (p.lse != nullptr && e == 0) {
    p.lse[row * p.lse_stride_row + qh * p.lse_stride_head] =
        sum > 0.0f ? (m_use + log2f(sum)) * kLn2 : -INFINITY;
  }
}

}  // namespace eps::attention
