// Sparse paged decode attention (paged_attention.h): flash-decoding over block lists.
//
// One CTA per (row, KV head, head group, split) covers up to GT query heads of one KV
// head, so K and V are read once for all of them. A split is a run of `chunk` list
// entries; splits > 1 write float partials (output normalised by its own sum, and its
// log2-sum-exp) that CombineKernel merges. Inside a CTA, warps take tiles of TT tokens
// round-robin; a lane holds 8 consecutive elements (one 16-byte load) of one token's K
// and V row, LPT = D/8 lanes cover a row, TP = 32/LPT tokens per pass, PT passes per
// tile, all loads of a tile issued before the first use. Scores live in the log2
// domain (q is prescaled by softmax_scale * log2(e)), so exp2 is one instruction.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "gpu/attention/paged_attention.h"
#include "gpu/attention/params_check.h"
#include "gpu/attention/row_list.h"

namespace eps::attention {
namespace {

constexpr int kWarps = 4;  // warps per CTA
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Launch shape, computed on the host in one place (Plan()).
struct Plan {
  int gt = 1;           // query heads per CTA (template parameter): 1, 2, 4 or 8
  int head_groups = 1;  // CTAs per (row, KV head) along the query heads
  int splits = 1;       // CTAs per (row, KV head, head group) along the list
  int chunk = 1;        // list entries per split
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

// Writes a zero output and lse -inf for heads [qh0, qh0 + n) of `row`: the result of a
// row whose list was refused (NaN-free, and recognisable through lse).
template <typename T>
__device__ void WriteEmpty(const EpsAttnParams& p, int64_t row, int qh0, int n, int d) {
  for (int i = threadIdx.x; i < n * d; i += blockDim.x) {
    const int64_t qh = qh0 + i / d;
    T* out = static_cast<T*>(p.out) + row * p.out_stride_row + qh * p.out_stride_head;
    out[i % d] = FromFloat<T>(0.0f);
    if (p.lse != nullptr && i % d == 0) {
      p.lse[row * p.lse_stride_row + qh * p.lse_stride_head] = -INFINITY;
    }
  }
}

template <typename T, int D, int GT>
__global__ void __launch_bounds__(kThreads)
    SplitKernel(const __grid_constant__ EpsAttnParams p, const Plan plan) {
  constexpr int kLpt = D / 8;           // lanes per token row
  constexpr int kTp = 32 / kLpt;        // tokens per pass
  constexpr int kPt = GT <= 4 ? 8 : 4;  // passes per tile
  constexpr int kTt = kPt * kTp;        // tokens per tile
  constexpr int kIdsPerTile = kTt > 16 ? kTt / 16 : 1;

  // blockIdx.x = ((row * kv_heads + kv_head) * head_groups + head_group) * splits + split
  int64_t index = blockIdx.x;
  const int split = static_cast<int>(index % plan.splits);
  index /= plan.splits;
  const int head_group = static_cast<int>(index % plan.head_groups);
  index /= plan.head_groups;
  const int kv_head = static_cast<int>(index % p.num_kv_heads);
  const int64_t row = index / p.num_kv_heads;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int qh0 = kv_head * group + head_group * GT;   // first query head of this CTA
  const int heads = min(GT, group - head_group * GT);  // valid heads of this CTA

  const RowList list = ResolveRow(p, row, kv_head);
  if (list.error != kListOk) {
    if (split == 0 && head_group == 0 && threadIdx.x == 0) {
      RecordError(p.error_word, list.error, row, kv_head, list.value);
    }
    if (plan.splits == 1) WriteEmpty<T>(p, row, qh0, heads, D);
    return;  // with splits, CombineKernel writes the empty result
  }
  const int first_entry = split * plan.chunk;
  if (first_entry >= list.count) return;  // CombineKernel reads only the active splits
  const int t_begin = first_entry * 16;
  const int t_end = min(min(list.count, first_entry + plan.chunk) * 16, list.tokens);

  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
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
  float acc[GT][8];  // running output over this lane's tokens
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
  }

  // Block ids are loaded one tile ahead, so that a tile's K/V loads never wait on them.
  int32_t next_ids[kIdsPerTile];
  auto load_ids = [&](int tile, int32_t(&ids)[kIdsPerTile]) {
#pragma unroll
    for (int i = 0; i < kIdsPerTile; ++i) {
      const int entry = tile / 16 + i;
      ids[i] = tile < t_end && entry < list.count ? __ldg(list.blocks + entry) : 0;
    }
  };
  load_ids(t_begin + warp * kTt, next_ids);
  for (int tile = t_begin + warp * kTt; tile < t_end; tile += kWarps * kTt) {
    // This tile's block ids (warp-uniform), checked before any address is formed.
    int32_t ids[kIdsPerTile];
    bool id_ok[kIdsPerTile];
#pragma unroll
    for (int i = 0; i < kIdsPerTile; ++i) {
      const int entry = tile / 16 + i;
      ids[i] = next_ids[i];
      id_ok[i] = ids[i] >= 0 && ids[i] < p.num_blocks;
      if (!id_ok[i] && entry < list.count && lane == 0) {
        RecordError(p.error_word, kListBlockId, row, kv_head, ids[i]);
      }
    }
    load_ids(tile + kWarps * kTt, next_ids);
    uint4 kv[2][kPt];
    bool valid[kPt];
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
    // groups of the warp, so that m stays warp-uniform.
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float tile_max = s[0][g];
#pragma unroll
      for (int pass = 1; pass < kPt; ++pass) tile_max = fmaxf(tile_max, s[pass][g]);
#pragma unroll
      for (int o = kLpt; o < 32; o *= 2) {
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
      }
      const float m_new = fmaxf(m[g], tile_max);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a tile of bad ids only
      const float factor = exp2f(m[g] - m_use);
      m[g] = m_new;
      l[g] *= factor;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] *= factor;
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
  // Across warps through shared memory.
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
      // partial_out [batch, num_q_heads, splits, D], partial_lse [batch, num_q_heads, splits]
      const int64_t slot = (row * p.num_q_heads + qh) * plan.splits + split;
      float* partial_out = static_cast<float*>(p.workspace);
      float* partial_lse =
          reinterpret_cast<float*>(static_cast<char*>(p.workspace) + plan.lse_offset);
      partial_out[slot * D + e] = o * inv;
      if (e == 0) partial_lse[slot] = lse2;
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
    WriteEmpty<T>(p, row, qh, 1, D);
    return;
  }
  const int active = (list.count + plan.chunk - 1) / plan.chunk;
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

// Multiprocessor count of the current device, read once per device.
int32_t SmCount(int* sms) {
  static std::mutex mu;
  static std::vector<int> cache;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    return Fail(EPS_ATTN_ECUDA, std::string("cudaGetDevice: ") + cudaGetErrorString(e));
  }
  std::lock_guard<std::mutex> lock(mu);
  if (device >= static_cast<int>(cache.size())) cache.resize(device + 1, 0);
  if (cache[device] == 0) {
    cudaError_t e = cudaDeviceGetAttribute(&cache[device], cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) {
      return Fail(EPS_ATTN_ECUDA, std::string("cudaDeviceGetAttribute(MultiProcessorCount): ") +
                                      cudaGetErrorString(e));
    }
  }
  *sms = cache[device];
  return EPS_ATTN_OK;
}

// The launch shape: splits sized so that the grid holds about kCtasPerSm CTAs per SM
// when every list is as long as its row allows (a gated list shorter than that
// leaves trailing splits idle; they return at once), and no split shorter than
// kMinChunk entries, where the partials would cost more than they spread.
constexpr int64_t kCtasPerSm = 8;
constexpr int64_t kMinChunk = 8;

int32_t MakePlan(const EpsAttnParams& p, Plan* plan) {
  const int group = p.num_q_heads / p.num_kv_heads;
  plan->gt = group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8;
  plan->head_groups = (group + plan->gt - 1) / plan->gt;
  const int64_t width = p.length_kind == EPS_ATTN_VISIT_COUNT
                            ? std::max(p.max_list_blocks, p.dense_max_blocks)
                            : p.max_list_blocks;
  const int64_t rows = int64_t{p.batch} * p.num_kv_heads * plan->head_groups;
  int64_t chunk;
  if (p.num_splits > 0) {
    chunk = (width + p.num_splits - 1) / p.num_splits;
  } else {
    int sms = 0;
    if (int32_t code = SmCount(&sms); code != EPS_ATTN_OK) return code;
    const int64_t target = kCtasPerSm * sms;
    chunk = std::max(kMinChunk, (width * rows + target - 1) / target);
  }
  chunk = std::min(chunk, width);
  plan->chunk = static_cast<int>(chunk);
  plan->splits = static_cast<int>((width + chunk - 1) / chunk);
  if (int64_t{p.batch} * p.num_q_heads > INT32_MAX) {  // CombineKernel's grid
    return Fail(EPS_ATTN_EINVAL,
                "batch * num_q_heads = " + std::to_string(int64_t{p.batch} * p.num_q_heads) +
                    " is too many rows for one launch");
  }
  if (rows * plan->splits > INT32_MAX) {
    return Fail(EPS_ATTN_EINVAL, "batch * num_kv_heads * splits = " +
                                     std::to_string(rows * plan->splits) + " CTAs is too many");
  }
  plan->workspace_bytes = 0;
  plan->lse_offset = 0;
  if (plan->splits > 1) {
    const uint64_t slots = uint64_t(p.batch) * p.num_q_heads * plan->splits;
    plan->lse_offset = (slots * p.head_dim * sizeof(float) + 255) / 256 * 256;
    plan->workspace_bytes = plan->lse_offset + slots * sizeof(float);
  }
  return EPS_ATTN_OK;
}

template <typename T, int D, int GT>
cudaError_t LaunchSplit(const EpsAttnParams& p, const Plan& plan, cudaStream_t stream) {
  const int64_t ctas = int64_t{p.batch} * p.num_kv_heads * plan.head_groups * plan.splits;
  SplitKernel<T, D, GT><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(p, plan);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t Launch(const EpsAttnParams& p, const Plan& plan, cudaStream_t stream) {
  cudaError_t e;
  switch (plan.gt) {
    case 1:
      e = LaunchSplit<T, D, 1>(p, plan, stream);
      break;
    case 2:
      e = LaunchSplit<T, D, 2>(p, plan, stream);
      break;
    case 4:
      e = LaunchSplit<T, D, 4>(p, plan, stream);
      break;
    default:
      e = LaunchSplit<T, D, 8>(p, plan, stream);
      break;
  }
  if (e != cudaSuccess || plan.splits == 1) return e;
  const unsigned combines = static_cast<unsigned>(int64_t{p.batch} * p.num_q_heads);
  CombineKernel<T, D><<<combines, D, 0, stream>>>(p, plan);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchDtype(const EpsAttnParams& p, const Plan& plan, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64:
      return Launch<T, 64>(p, plan, stream);
    case 128:
      return Launch<T, 128>(p, plan, stream);
    default:
      return Launch<T, 256>(p, plan, stream);
  }
}

}  // namespace
}  // namespace eps::attention

using eps::attention::CheckParams;
using eps::attention::Fail;
using eps::attention::Succeed;

extern "C" int32_t eps_attn_workspace_bytes(const EpsAttnParams* params, uint64_t* bytes) {
  if (params == nullptr || bytes == nullptr)
    return Fail(EPS_ATTN_EINVAL, "params or bytes is NULL");
  if (std::string why = CheckParams(*params, /*check_pointers=*/false); !why.empty()) {
    return Fail(EPS_ATTN_EINVAL, why);
  }
  eps::attention::Plan plan;
  if (int32_t code = eps::attention::MakePlan(*params, &plan); code != EPS_ATTN_OK) return code;
  *bytes = plan.workspace_bytes;
  return Succeed();
}

extern "C" int32_t eps_attn_paged_decode(const EpsAttnParams* params, void* stream) {
  if (params == nullptr) return Fail(EPS_ATTN_EINVAL, "params is NULL");
  const EpsAttnParams& p = *params;
  if (std::string why = CheckParams(p, /*check_pointers=*/true); !why.empty()) {
    return Fail(EPS_ATTN_EINVAL, why);
  }
  eps::attention::Plan plan;
  if (int32_t code = eps::attention::MakePlan(p, &plan); code != EPS_ATTN_OK) return code;
  if (plan.workspace_bytes > 0) {
    if (p.workspace == nullptr || p.workspace_bytes < plan.workspace_bytes) {
      return Fail(EPS_ATTN_EINVAL,
                  "workspace_bytes=" + std::to_string(p.workspace_bytes) + " (workspace " +
                      (p.workspace ? "set" : "NULL") + ") but this call needs " +
                      std::to_string(plan.workspace_bytes) + " (eps_attn_workspace_bytes)");
    }
    if (reinterpret_cast<uintptr_t>(p.workspace) % 256 != 0) {
      return Fail(EPS_ATTN_EINVAL, "workspace is not 256-byte aligned");
    }
  }
  const auto s = static_cast<cudaStream_t>(stream);
  const cudaError_t e = p.dtype == EPS_ATTN_BF16
                            ? eps::attention::LaunchDtype<__nv_bfloat16>(p, plan, s)
                            : eps::attention::LaunchDtype<__half>(p, plan, s);
  if (e != cudaSuccess) {
    return Fail(EPS_ATTN_ECUDA, std::string("kernel launch: ") + cudaGetErrorString(e));
  }
  return Succeed();
}

extern "C" int32_t eps_attn_read_error(int32_t* error_word, void* stream, int32_t clear) {
  if (error_word == nullptr) return Fail(EPS_ATTN_EINVAL, "error_word is NULL");
  const auto s = static_cast<cudaStream_t>(stream);
  int32_t word[EPS_ATTN_ERROR_WORDS] = {};
  cudaError_t e = cudaMemcpyAsync(word, error_word, sizeof(word), cudaMemcpyDeviceToHost, s);
  if (e == cudaSuccess && clear != 0) e = cudaMemsetAsync(error_word, 0, sizeof(word), s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) {
    return Fail(EPS_ATTN_ECUDA, std::string("reading error_word: ") + cudaGetErrorString(e));
  }
  if (word[0] == 0) return Succeed();
  return Fail(EPS_ATTN_ELIST, eps::attention::DescribeListError(word));
}
