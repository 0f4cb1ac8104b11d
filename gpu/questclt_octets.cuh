// questclt's two sums (HeadSums centre and spread) for a warp's records, a
// lane per octet of channels, for head dimensions known at compile time (64,
// 128, 256). The general path (warp_sums.cuh QuestCltSumsWarp) has all 32
// lanes share each record: its runtime loops over d, 4-byte loads and one
// transposed reduction of every (record, head) sum over the whole warp cost
// about 180 instructions per record (docs/benchmarks/gpu-history-2026-11-25-26.md,
// "2026-11-25, third session").
//
// Here the warp takes 32 / L records per pass, L = d / 8 lanes each (lanes
// L·k … L·k + L − 1 record k): lane j of a record owns channels 8j … 8j + 7,
// the same in every pass, so it holds those channels' query terms (q/2 and
// q²/4 of each head) in registers for the whole call. (An earlier version
// read them from shared memory for every record: Nsight Compute showed the
// L1/shared pipe at 88 % while DRAM stood at 43 %, 2026-11-26.) The lane copies
// its channels' minima and maxima (16 + 16 bytes; quest8: 8 + 8) into its own
// slots of a ring of shared memory by cp.async, kOctetStages − 1 passes ahead,
// so no copy holds a register and, reading back only what it copied, the lane
// needs no warp barrier. Then per channel once: lo + hi and (hi − lo)², and per
// head two FMAs; the (record, head) sums are added over the record's L lanes
// (GroupTransposeSum) and handed to the lane that owns the record.
//
// kQuest8: the sums run over the quest8 part's int8 codes (in code units;
// QuestCltScore applies the record's scale): half the bytes, the same
// channels and query terms per lane.
//
// Requires the quest part (and quest8) on a 16-byte boundary (core/layout.h
// puts them there). The sums run in another order than core/'s and than the
// general path's: a float rounding apart, as the general path is from core/.
#pragma once

#include <cuda_fp16.h>
#include <cuda_pipeline.h>

#include <cstdint>

#include "gpu/bounds.cuh"
#include "gpu/warp_sums.cuh"

namespace eps::gpu {

inline constexpr int kOctetStages = 4;  // passes in flight: the one read and three copying

// The head dimensions with an octet path.
__host__ __device__ constexpr bool HasOctetPath(int d) { return d == 64 || d == 128 || d == 256; }

// The octet path's query terms in shared memory, from which each lane loads its
// channels' terms once: q/2 of every head, then q²/4, each head's d channels
// with 4 words of padding after every 32 (OctetQueryIndex).
__host__ __device__ constexpr int OctetQueryStride(int d) { return d + d / 8; }
__host__ __device__ constexpr int OctetQueryIndex(int channel) {
  return channel + channel / 32 * 4;
}

// Shared memory (4-byte words) of one warp's ring: kOctetStages passes of 32
// lanes × two 16-byte slots (the lane's minima, then its maxima; quest8 fills
// one slot with both).
__host__ __device__ constexpr size_t OctetRingWarpWords() {
  return static_cast<size_t>(kOctetStages) * 32 * 2 * 4;
}

// Sums v over each group of 2·kOffset lanes, transposed: each level trades half
// of a lane's values with its partner kOffset lanes away (TradeHalves), down to
// offset 1 or to one value per lane, whose remaining levels are a butterfly
// sum. With L lanes per group and kHeld = max(kValues / L, 1), value v ends in
// group lane (v / kHeld) · (L · kHeld / kValues), at out[v % kHeld].
template <int kValues, int kOffset, int kHeld>
__device__ __forceinline__ void GroupTransposeSum(float (&v)[kValues], int lane,
                                                  float (&out)[kHeld]) {
  if constexpr (kOffset == 0) {
    static_assert(kValues == kHeld);
#pragma unroll
    for (int i = 0; i < kValues; ++i) out[i] = v[i];
  } else if constexpr (kValues == 1) {
    float sum = v[0];
#pragma unroll
    for (int offset = kOffset; offset > 0; offset /= 2) {
      sum += __shfl_xor_sync(kFullWarp, sum, offset);
    }
    out[0] = sum;
  } else {
    float kept[kValues / 2];
    TradeHalves<kValues, kOffset>(v, lane, kept);  // warp_sums.cuh
    GroupTransposeSum<kValues / 2, kOffset / 2, kHeld>(kept, lane, out);
  }
}

// Sums for the warp's records (`rec`: the lane's record, null for none); `qc`
// and `qs` [heads, OctetQueryStride(kD)] hold q/2 and q²/4 of the pass's heads
// at OctetQueryIndex (`heads` of the kHeads real); `ring`: the warp's
// OctetRingWarpWords() words, 16-byte aligned. Every lane of the warp must call
// it; sums.centre and sums.spread [0, kHeads) receive the lane's own record's sums.
template <int kD, int kHeads, bool kQuest8 = false>
__device__ inline void QuestCltSumsOctets(const float* rec, const RecordOffsets& o, const float* qc,
                                          const float* qs, int heads, HeadSums& sums, int lane,
                                          float* ring) {
  static_assert(HasOctetPath(kD) && (kHeads == 4 || kHeads == 8));
  constexpr int kLanes = kD / 8;          // lanes per record
  constexpr int kRecords = 32 / kLanes;   // records per pass
  constexpr int kSlot = kQuest8 ? 1 : 2;  // 16-byte slots a lane fills per pass
  constexpr int kValues = 2 * kHeads;     // centre then spread, per head
  constexpr int kHeld = kValues >= kLanes ? kValues / kLanes : 1;
  constexpr int kSpacing = kLanes * kHeld / kValues;  // group lanes between held values
  unsigned pending = __ballot_sync(kFullWarp, rec != nullptr);
  const auto address = reinterpret_cast<unsigned long long>(rec);
  const int group = lane / kLanes, j = lane % kLanes;
  // This lane's channels' query terms, for the whole call.
  float cq[kHeads][8], sq[kHeads][8];
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    const int at = (h < heads ? h : 0) * OctetQueryStride(kD) + OctetQueryIndex(8 * j);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      cq[h][i] = qc[at + i];
      sq[h][i] = qs[at + i];
    }
  }
  float4* slots = reinterpret_cast<float4*>(ring);  // [stage][kSlot][32 lanes]
  // Per pass queued, 8 bits, oldest lowest: bit 7 the lane's group has a record,
  // bits 0-6 the index + 1 of the lane's own record in the pass (0: none).
  unsigned queue = 0;
  int issued = 0;
  auto issue = [&](int queued) {
    if (pending != 0) {
      int src = -1, mine = -1;
#pragma unroll
      for (int k = 0; k < kRecords; ++k) {  // the pass: the next records in lane order
        const int s = pending != 0 ? __ffs(pending) - 1 : -1;
        if (k == group) src = s;
        if (s == lane) mine = k;
        pending &= pending - 1;
      }
      const auto* r = reinterpret_cast<const float*>(__shfl_sync(kFullWarp, address, max(src, 0)));
      float4* slot = slots + (issued % kOctetStages) * kSlot * 32 + lane;
      if (src >= 0) {
        if constexpr (kQuest8) {  // channels 8j …: bytes of the min run, then of the max run
          const char* codes = reinterpret_cast<const char*>(r + o.quest8) + 8 * j;
          char* dst = reinterpret_cast<char*>(slot);
          __pipeline_memcpy_async(dst, codes, 8);
          __pipeline_memcpy_async(dst + 8, codes + kD, 8);
        } else {
          __pipeline_memcpy_async(slot, r + o.quest_min + 4 * j, 16);
          __pipeline_memcpy_async(slot + 32, r + o.quest_max + 4 * j, 16);
        }
      }
      queue |= (static_cast<unsigned>(mine + 1) | (src >= 0 ? 0x80u : 0u)) << (8 * queued);
      ++issued;
    }
    __pipeline_commit();
  };
#pragma unroll
  for (int s = 0; s < kOctetStages - 1; ++s) issue(s);
  for (int done = 0; done < issued; ++done) {
    // Into the slot of pass done - 1, which this lane alone read, and has.
    issue(issued - done);
    __pipeline_wait_prior(kOctetStages - 1);
    const unsigned entry = queue & 0xFFu;
    queue >>= 8;
    const int mine = static_cast<int>(entry & 0x7Fu) - 1;
    float acc[kValues] = {};  // centre[h] at h, spread[h] at kHeads + h
    if ((entry & 0x80u) != 0) {
      const float4* slot = slots + (done % kOctetStages) * kSlot * 32 + lane;
      float sum[8], width2[8];
      if constexpr (kQuest8) {
        const float4 both = slot[0];
        const int8_t* code = reinterpret_cast<const int8_t*>(&both);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int l = code[i], u = code[8 + i];
          sum[i] = static_cast<float>(l + u);
          const float w = static_cast<float>(u - l);
          width2[i] = w * w;
        }
      } else {
        const float4 lo4 = slot[0], hi4 = slot[32];
        const __half2* lo = reinterpret_cast<const __half2*>(&lo4);
        const __half2* hi = reinterpret_cast<const __half2*>(&hi4);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 l = __half22float2(lo[i]), u = __half22float2(hi[i]);
          sum[2 * i] = l.x + u.x;
          sum[2 * i + 1] = l.y + u.y;
          const float dx = u.x - l.x, dy = u.y - l.y;
          width2[2 * i] = dx * dx;
          width2[2 * i + 1] = dy * dy;
        }
      }
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          acc[h] = fmaf(cq[h][i], sum[i], acc[h]);
          acc[kHeads + h] = fmaf(sq[h][i], width2[i], acc[kHeads + h]);
        }
      }
    }
    float held[kHeld];
    GroupTransposeSum<kValues, kLanes / 2, kHeld>(acc, lane, held);
    const int base = kLanes * max(mine, 0);
#pragma unroll
    for (int v = 0; v < kValues; ++v) {
      const float total = __shfl_sync(kFullWarp, held[v % kHeld], base + v / kHeld * kSpacing);
      if (mine >= 0) {
        if (v < kHeads) {
          sums.centre[v] = total;
        } else {
          sums.spread[v - kHeads] = total;
        }
      }
    }
  }
  __pipeline_wait_prior(0);  // no copy outlives the call (the tail's groups are empty)
}

}  // namespace eps::gpu
