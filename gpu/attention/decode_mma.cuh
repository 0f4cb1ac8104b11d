// The tensor-core unit of sparse paged decode attention (KernelVariant::kWarpMma):
// q·Kᵀ and P·V as mma.m16n8k16 (mma_ptx.cuh), so that a score costs no warp shuffles
// and the products no CUDA-core FMAs. Included only by paged_attention.cu; the plan,
// the split workspace and CombineKernel are decode_kernels.cuh's.
//
// A unit is one warp per (row, KV head, head group, split), numbered as kWarpLean's
// (4 warps of a CTA on adjacent KV heads). It takes one 16-token block per step:
//   Sᵀ = K · Qᵀ   M = 16 tokens of the block, N = 8 query heads (the head group padded
//                 with zero rows), K = d in d/16 steps;
//   Oᵀ += Vᵀ · Pᵀ M = d in d/16 tiles, N = 8 heads, K = the block's 16 tokens.
// Both products sum over a dimension the result does not show, so that dimension may
// be permuted freely if both operands use the same permutation; the permutations are
// chosen so that every K and V fragment comes straight from 16-byte global loads, with
// no staging in shared memory (only q's fragments wait there):
//   q·Kᵀ: lane (g, t) = (lane / 4, lane % 4) holds elements [t·d/4, (t+1)·d/4) of
//         tokens g and g+8 (4 lanes read a 2·d-byte row, coalesced); step j takes words
//         2j and 2j+1 of that slice, and Q's fragment (head g) the same words.
//   P·V:  lane (g, t) holds elements [g·d/8, (g+1)·d/8) of tokens 2t, 2t+1, 2t+8, 2t+9;
//         tile i takes word i of each (element g·d/8 + 2i as row g of the tile,
//         + 2i + 1 as row g+8), paired across tokens with a byte permute.
// P comes out of the first product in the C layout (lane: tokens g, g+8 × heads 2t,
// 2t+1) and enters the second as a B fragment (tokens 2t.. × head g): the transpose of
// each 8×8 half, one movmatrix each. P is rounded to the cache's dtype for the second
// product, as FlashAttention does; the row sums and the lse use P in float32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/attention/decode_kernels.cuh"
#include "gpu/attention/mma_ptx.cuh"

namespace eps::attention {

// CTAs per SM the register budget is set for: 4 (at most 128 registers, 16 warps) up to
// d = 128; d = 256 holds twice the fragments, so 2.
template <int D, bool kFeedback>
constexpr int MmaCtasPerSm() {
  return D <= 64 || (D <= 128 && !kFeedback) ? 4 : D <= 128 ? 3 : 2;
}

// Selection feedback of one unit (paged_attention.h): each head's log-sum-exp over each
// block, summed (log-add-exp) over the run of consecutive blocks of one group (epsd lists
// a group's blocks next to each other) and combined into the group's entry when the run
// ends. Lane (h, t), h < 2, holds head 2t + h; its row's first entry is found once
// (base), each block's position is loaded a block ahead by the caller. The combine is a
// CAS from NaN whose result is checked only at the next flush, so the warp does not wait
// on the atomic; a CAS that found a value (another unit's blocks of the group) is redone
// with log-add-exp.
struct FeedbackRun {
  static constexpr unsigned kNaN = 0x7FC00000u;  // what epsd and the clients write
  int32_t base = -1;     // this lane's head's first entry; -1: the lane writes nothing
  int32_t entry = -1;    // the running group's entry (entries < 2^31: CheckFeedback)
  float lse = 0.0f;      // its log-sum-exp so far
  int32_t pending = -1;  // the last flushed entry, its value and the CAS's result
  float pending_lse = 0.0f;
  unsigned prior = kNaN;

  __device__ __forceinline__ void Start(const EpsAttnParams& p, int64_t row, int kv_head, int qh0,
                                        int heads) {
    const int lane = threadIdx.x % 32;
    const int h = lane / 4;
    const int head = 2 * (lane % 4) + h;
    if (h >= 2 || head >= heads) return;
    int32_t error = 0;
    int32_t value = 0;
    base = static_cast<int32_t>(FeedbackRowBase(p, row, qh0 + head, &error, &value));
    if (error != kListOk) RecordError(p.error_word, error, row, kv_head, value);
  }
  __device__ __forceinline__ void Settle(float* feedback) {
    if (pending >= 0 && prior != kNaN) AtomicLogAddExp(feedback + pending, pending_lse);
    pending = -1;
  }
  __device__ __forceinline__ void Flush(float* feedback) {
    if (entry < 0) return;
    Settle(feedback);
    prior = atomicCAS(reinterpret_cast<unsigned*>(feedback + entry), kNaN, __float_as_uint(lse));
    pending = entry;
    pending_lse = lse;
    entry = -1;
  }
  // One block at `position` in its sequence: x holds lane (g, t)'s scores of tokens g,
  // g+8 × heads 2t, 2t+1 (log2 domain, -inf past the block's tokens), block_max the
  // heads' maxima over the block; sums run over the 8 lanes of the same t. Every lane of
  // the warp calls it.
  __device__ __forceinline__ void Block(const EpsAttnParams& p, int64_t row, int kv_head,
                                        int32_t position, const float (&x)[4],
                                        const float (&block_max)[2]) {
    const int lane = threadIdx.x % 32;
    float sum[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sum[h] = exp2f(x[h] - block_max[h]) + exp2f(x[2 + h] - block_max[h]);
#pragma unroll
      for (int off = 4; off < 32; off *= 2) sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], off);
    }
    if (base < 0) return;
    int32_t error = 0;
    int32_t value = 0;
    const int32_t group = FeedbackGroup(p, position, &error, &value);
    if (group < 0) {
      RecordError(p.error_word, error, row, kv_head, value);
      return;
    }
    const int h = lane / 4;
    const float v =
        ((h == 0 ? block_max[0] : block_max[1]) + log2f(h == 0 ? sum[0] : sum[1])) * kLn2;
    if (base + group == entry) {
      const float hi = fmaxf(lse, v);
      lse = hi + log1pf(expf(fminf(lse, v) - hi));
    } else {
      Flush(p.feedback);
      entry = base + group;
      lse = v;
    }
  }
  __device__ __forceinline__ void Finish(float* feedback) {
    Flush(feedback);
    Settle(feedback);
  }
};

// kFeedback: also writes selection feedback (FeedbackRun); a separate instance, so that
// the plain kernel keeps its registers.
template <typename T, int D, bool kFeedback>
__global__ void __launch_bounds__(kThreads, (MmaCtasPerSm<D, kFeedback>()))
    MmaSplitKernel(const __grid_constant__ EpsAttnParams p, const Plan plan) {
  constexpr int kSteps = D / 16;   // k-steps of q·Kᵀ, m-tiles of P·V
  constexpr int kKWords = D / 8;   // 32-bit words per lane and K token (d/4 elements)
  constexpr int kVWords = D / 16;  // 32-bit words per lane and V token (d/8 elements)
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;

  // unit = ((row * head_groups + head_group) * splits + split) * kv_heads + kv_head
  int64_t index = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32;
  const int kv_head = static_cast<int>(index % p.num_kv_heads);
  index /= p.num_kv_heads;
  const int split = static_cast<int>(index % plan.splits);
  index /= plan.splits;
  const int head_group = static_cast<int>(index % plan.head_groups);
  const int64_t row = index / plan.head_groups;
  if (row >= p.batch) return;  // the last CTA's spare warps
  const int group = p.num_q_heads / p.num_kv_heads;
  const int qh0 = kv_head * group + head_group * plan.gt;        // first query head of this unit
  const int heads = min(plan.gt, group - head_group * plan.gt);  // valid heads: <= 8

  const RowList list = ResolveRow(p, row, kv_head);
  if (list.error != kListOk) {
    if (split == 0 && head_group == 0 && lane == 0) {
      RecordError(p.error_word, list.error, row, kv_head, list.value);
    }
    if (plan.splits == 1) WriteEmpty<T>(p, row, qh0, heads, D, lane, 32);
    return;  // with splits, CombineKernel writes the empty result
  }
  const int chunk = SplitChunk(plan, list.count);
  const int first_entry = split * chunk;
  if (first_entry >= list.count) return;  // CombineKernel reads only the active splits
  const int end_entry = min(list.count, first_entry + chunk);
  const int t_end = min(end_entry * 16, list.tokens);

  // Qᵀ as B fragments: head g (zero past the group), elements [t·d/4, (t+1)·d/4), not
  // prescaled (the scale is applied to the float32 scores, so q stays exact). They wait
  // in shared memory, each lane reading back only its own slots at every step: in
  // registers they spill at d = 128 within the 128 registers of 4 CTAs per SM.
  __shared__ uint4 q_frags[kWarps][kKWords / 4][32];
  uint4(&qf)[kKWords / 4][32] = q_frags[threadIdx.x / 32];
  {
    const T* q_row = static_cast<const T*>(p.q) + row * p.q_stride_row +
                     (qh0 + min(g, heads - 1)) * p.q_stride_head + t * (D / 4);
#pragma unroll
    for (int c = 0; c < kKWords / 4; ++c) {
      qf[c][lane] = g < heads ? *reinterpret_cast<const uint4*>(q_row + c * 8) : uint4{};
    }
  }
  const float q_scale = p.softcap > 0.0f ? p.softmax_scale / p.softcap : p.softmax_scale * kLog2e;
  const float cap_scale = p.softcap * kLog2e;

  const int64_t head_offset = kv_head * p.kv_stride_head;
  const char* k_lane =
      static_cast<const char*>(p.k_cache) + (head_offset + t * (D / 4)) * int64_t{sizeof(T)};
  const char* v_lane =
      static_cast<const char*>(p.v_cache) + (head_offset + g * (D / 8)) * int64_t{sizeof(T)};
  const int64_t block_bytes = p.kv_stride_block * int64_t{sizeof(T)};
  const int64_t token_bytes = p.kv_stride_token * int64_t{sizeof(T)};

  uint32_t kw[2][kKWords];              // K of tokens g, g+8 of the block in flight
  uint32_t vw[4][kVWords];              // V of tokens 2t, 2t+1, 2t+8, 2t+9
  float m[2] = {-INFINITY, -INFINITY};  // running max of heads 2t, 2t+1 (log2 domain)
  float l[2] = {0.0f, 0.0f};            // running sums over this lane's tokens g, g+8
  float o[kSteps][4];                   // Oᵀ fragments, scaled by 2^-m
#pragma unroll
  for (int i = 0; i < kSteps; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

  auto load_id = [&](int entry) { return entry < end_entry ? __ldg(list.blocks + entry) : 0; };
  // Tokens of `entry` to read: 0 past the run or for a bad id (recorded, never read).
  auto block_tokens = [&](int entry, int32_t id) {
    if (entry >= end_entry) return 0;
    if (id < 0 || id >= p.num_blocks) {
      if (lane == 0) RecordError(p.error_word, kListBlockId, row, kv_head, id);
      return 0;
    }
    return min(16, t_end - entry * 16);
  };
  // Tokens past `n` load as zeros: their slots may hold anything (NaN), and 0·NaN would
  // reach the output through P·V even with P = 0.
  auto issue_k = [&](int32_t id, int n) {
    const char* base = k_lane + (n > 0 ? id : 0) * block_bytes;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int token = g + 8 * r;
#pragma unroll
      for (int c = 0; c < kKWords / 4; ++c) {
        const uint4 x = token < n ? LoadStreaming(base + token * token_bytes + c * 16) : uint4{};
        kw[r][4 * c] = x.x;
        kw[r][4 * c + 1] = x.y;
        kw[r][4 * c + 2] = x.z;
        kw[r][4 * c + 3] = x.w;
      }
    }
  };
  auto issue_v = [&](int32_t id, int n) {
    const char* base = v_lane + (n > 0 ? id : 0) * block_bytes;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int token = 2 * t + (r & 1) + 8 * (r >> 1);
#pragma unroll
      for (int c = 0; c < kVWords / 4; ++c) {
        const uint4 x = token < n ? LoadStreaming(base + token * token_bytes + c * 16) : uint4{};
        vw[r][4 * c] = x.x;
        vw[r][4 * c + 1] = x.y;
        vw[r][4 * c + 2] = x.z;
        vw[r][4 * c + 3] = x.w;
      }
    }
  };

  // The next block's K and V are issued as soon as this block's registers are free, its
  // id one step ahead. Issuing its K before this block's softmax instead (K is free
  // there) would keep loads in flight through it, but costs spills at 128 registers.
  [[maybe_unused]] FeedbackRun feedback;
  const int32_t id_first = load_id(first_entry);
  int32_t id_next = load_id(first_entry + 1);
  int n_cur = block_tokens(first_entry, id_first);
  // feedback: the position of the block in use and of the next, loaded a block ahead
  [[maybe_unused]] int32_t position_cur = 0;
  if constexpr (kFeedback) {
    feedback.Start(p, row, kv_head, qh0, heads);
    if (n_cur > 0) position_cur = __ldg(p.block_positions + id_first);
  }
  issue_k(id_first, n_cur);
  issue_v(id_first, n_cur);
  for (int entry = first_entry; entry < end_entry; ++entry) {
    const int32_t id_after = load_id(entry + 2);
    [[maybe_unused]] int32_t position_next = 0;
    if constexpr (kFeedback) {
      if (entry + 1 < end_entry && id_next >= 0 && id_next < p.num_blocks) {
        position_next = __ldg(p.block_positions + id_next);
      }
    }
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // Sᵀ: tokens g, g+8 × heads 2t, 2t+1
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      const uint32_t a[4] = {kw[0][2 * j], kw[1][2 * j], kw[0][2 * j + 1], kw[1][2 * j + 1]};
      const uint4 q = qf[j / 2][lane];
      const uint32_t b[2] = {j % 2 == 0 ? q.x : q.z, j % 2 == 0 ? q.y : q.w};
      MmaM16N8K16<T>(s, a, b);
    }

    // Online softmax per head over the block's 16 tokens: the max over tokens g, g+8
    // and then over the 8 lanes of the same t, so m is the same in those lanes.
    float x[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v = s[i] * q_scale;
      if (p.softcap > 0.0f) v = cap_scale * tanhf(v);
      x[i] = g + 8 * (i / 2) < n_cur ? v : -INFINITY;
    }
    float block_max[2] = {fmaxf(x[0], x[2]), fmaxf(x[1], x[3])};
#pragma unroll
    for (int off = 4; off < 32; off *= 2) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        block_max[h] = fmaxf(block_max[h], __shfl_xor_sync(0xffffffffu, block_max[h], off));
      }
    }
    if constexpr (kFeedback) {
      if (n_cur > 0) feedback.Block(p, row, kv_head, position_cur, x, block_max);
    }
    // The rescale is skipped, warp-uniformly, when no head's max rises.
    if (__any_sync(0xffffffffu, block_max[0] > m[0] || block_max[1] > m[1])) {
      float factor[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float new_max = fmaxf(m[h], block_max[h]);
        factor[h] = new_max == m[h] ? 1.0f : exp2f(m[h] - new_max);  // 0 while m is -inf
        m[h] = new_max;
        l[h] *= factor[h];
      }
#pragma unroll
      for (int i = 0; i < kSteps; ++i) {
        o[i][0] *= factor[0];
        o[i][1] *= factor[1];
        o[i][2] *= factor[0];
        o[i][3] *= factor[1];
      }
    }
    float prob[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float m_use = m[i % 2] == -INFINITY ? 0.0f : m[i % 2];  // a block of bad ids only
      prob[i] = exp2f(x[i] - m_use);
    }
    l[0] += prob[0] + prob[2];
    l[1] += prob[1] + prob[3];
    const uint32_t pt[2] = {TransposeM8N8(PackPair<T>(prob[0], prob[1])),
                            TransposeM8N8(PackPair<T>(prob[2], prob[3]))};
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const uint32_t a[4] = {
          __byte_perm(vw[0][i], vw[1][i], 0x5410), __byte_perm(vw[0][i], vw[1][i], 0x7632),
          __byte_perm(vw[2][i], vw[3][i], 0x5410), __byte_perm(vw[2][i], vw[3][i], 0x7632)};
      MmaM16N8K16<T>(o[i], a, pt);
    }
    const int n_next = block_tokens(entry + 1, id_next);
    issue_k(id_next, n_next);
    issue_v(id_next, n_next);
    if constexpr (kFeedback) position_cur = position_next;
    id_next = id_after;
    n_cur = n_next;
  }

  if constexpr (kFeedback) feedback.Finish(p.feedback);

    // Row sums over the 8 lanes of the same t; lane (g, t) then writes elements
    // [g·d/8, (g+1)·d/8) of heads 2t and 2t+1: element g·d/8 + 2i is o[i][h], + 2i + 1 is
    // o[i][2 + h].
#pragma unroll
  for (int off = 4; off < 32; off *= 2) {
    l[0] += __shfl_xor_sync(0xffffffffu, l[0], off);
    l[1] += __shfl_xor_sync(0xffffffffu, l[1], off);
  }
  const int64_t slot0 = (row * p.num_q_heads + qh0) * plan.splits + split;
  float* partial_out = static_cast<float*>(p.workspace);
  float* partial_lse = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + plan.lse_offset);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = 2 * t + h;
    if (head >= heads) break;
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
    // log2-sum-exp of this split; -inf when every id was bad
    const float lse2 = l[h] > 0.0f ? m[h] + log2f(l[h]) : -INFINITY;
    const int64_t qh = qh0 + head;
    if (plan.splits == 1) {
      T* out =
          static_cast<T*>(p.out) + row * p.out_stride_row + qh * p.out_stride_head + g * (D / 8);
#pragma unroll
      for (int c = 0; c < kVWords / 4; ++c) {
        uint32_t w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          w[k] = PackPair<T>(o[4 * c + k][h] * inv, o[4 * c + k][2 + h] * inv);
        }
        *reinterpret_cast<uint4*>(out + 8 * c) = make_uint4(w[0], w[1], w[2], w[3]);
      }
      if (p.lse != nullptr && g == 0) {
        p.lse[row * p.lse_stride_row + qh * p.lse_stride_head] = lse2 * kLn2;
      }
    } else {
      // partial_out [batch, num_q_heads, splits, D], partial_lse [batch, num_q_heads, splits]
      const int64_t slot = slot0 + int64_t{head} * plan.splits;
      float4* dst = reinterpret_cast<float4*>(partial_out + slot * D + g * (D / 8));
#pragma unroll
      for (int c = 0; c < kSteps / 2; ++c) {
        dst[c] = make_float4(o[2 * c][h] * inv, o[2 * c][2 + h] * inv, o[2 * c + 1][h] * inv,
                             o[2 * c + 1][2 + h] * inv);
      }
      if (g == 0) partial_lse[slot] = lse2;
    }
  }
}

}  // namespace eps::attention
