// questclt's two sums (HeadSums centre and spread) for a warp's records, an
// octet of lanes per record, for head dimensions known at compile time (64,
// 128, 256). The general path (warp_sums.cuh QuestCltSumsWarp) has all 32
// lanes share each record: its runtime loops over d, 4-byte loads and one
// transposed reduction of every (record, head) sum over the whole warp cost
// about 180 instructions per record, which made the pre-pass bound by issue
// rather than by memory (docs/benchmarks/gpu.md, "2026-11-25, third session").
//
// Here the warp takes 4 records per pass, lanes 8k … 8k + 7 record k. Lane j
// copies 16-byte chunks j, j + 8, … of the record's minima and the same chunks
// of its maxima (channels 8c … 8c + 7 of chunk c) into its own slots of a ring
// of shared memory, by cp.async, kOctetStages - 1 passes ahead: each octet's
// copy instruction reads 128 contiguous bytes, no copy holds a register, and a
// lane reads back only what it copied, so no warp barrier is needed. Then per
// channel once: lo + hi and (hi − lo)², and per head two FMAs against the
// query's halves and quarters (q/2 and q²/4, prepared in shared memory by the
// scoring block); the (record, head) sums are added over the octet's 8 lanes
// only (3 shuffle levels) and handed to the lane that owns the record.
//
// kQuest8: the sums run over the quest8 part's int8 codes instead (in code
// units; QuestCltScore applies the record's scale). Lane j then copies 8 bytes
// of minima and the 8 bytes of maxima of the same channels 8c … 8c + 7 into
// the two halves of one 16-byte slot: half the bytes, the same channels and
// query terms per lane.
//
// Requires the quest part (and quest8) on a 16-byte boundary (core/layout.h
// puts them there).
// The sums run in another order than core/'s and than the general path's: a
// float rounding apart, as the general path is from core/.
#pragma once

#include <cuda_fp16.h>
#include <cuda_pipeline.h>

#include <cstdint>

#include "gpu/bounds.cuh"
#include "gpu/warp_sums.cuh"

namespace eps::gpu {

inline constexpr int kOctetStages = 3;   // passes in flight: the one read and two copying
inline constexpr int kOctetRecords = 4;  // records per pass: an octet of lanes each

// The head dimensions with an octet path.
__host__ __device__ constexpr bool HasOctetPath(int d) { return d == 64 || d == 128 || d == 256; }

// The octet path's query terms in shared memory: q/2 of every head, then q²/4,
// each head's d channels with 4 words of padding after every 32 (OctetQueryIndex),
// so that the 8 lanes of an octet, reading 16 bytes at channels 8j + 64c, hit 32
// distinct banks.
__host__ __device__ constexpr int OctetQueryStride(int d) { return d + d / 8; }
__host__ __device__ constexpr int OctetQueryIndex(int channel) {
  return channel + channel / 32 * 4;
}

// Shared memory (4-byte words) of one warp's ring: kOctetStages passes of 32
// lanes × d/32 chunks of 16 bytes (the lane's d/64 chunks of minima and of maxima).
__host__ __device__ constexpr size_t OctetRingWarpWords(int d) {
  return static_cast<size_t>(kOctetStages) * 32 * (d / 32) * 4;
}

// Sums v over the 8 lanes of each octet, transposed: each level trades half of
// a lane's values with its partner kOffset lanes away, so after the levels for
// offsets 4, 2 and 1, lane j of the octet holds the totals of values
// j·R … j·R + R − 1 (R = kValues / 8) in out[0, R).
template <int kValues, int kOffset = 4>
__device__ __forceinline__ void OctetTransposeSum(float (&v)[kValues], int lane,
                                                  float (&out)[kValues / (2 * kOffset)]) {
  static_assert(kValues >= 2 * kOffset && (kValues & (kValues - 1)) == 0);
  constexpr int kHalf = kValues / 2;
  float kept[kHalf];
  TradeHalves<kValues, kOffset>(v, lane, kept);  // warp_sums.cuh
  if constexpr (kOffset == 1) {
#pragma unroll
    for (int i = 0; i < kHalf; ++i) out[i] = kept[i];
  } else {
    OctetTransposeSum<kHalf, kOffset / 2>(kept, lane, out);
  }
}

// Sums for the warp's records (`rec`: the lane's record, null for none); `qc`
// and `qs` [heads, OctetQueryStride(kD)] hold q/2 and q²/4 of the pass's heads
// at OctetQueryIndex (`heads` of the kHeads real); `ring`: the warp's OctetRingWarpWords(kD) words,
// 16-byte aligned. Every lane of the warp must call it; sums.centre and sums.spread [0, kHeads)
// receive the lane's own record's sums.
template <int kD, int kHeads, bool kQuest8 = false>
__device__ inline void QuestCltSumsOctets(const float* rec, const RecordOffsets& o, const float* qc,
                                          const float* qs, int heads, HeadSums& sums, int lane,
                                          float* ring) {
  static_assert(HasOctetPath(kD) && (kHeads == 4 || kHeads == 8));
  constexpr int kChunks = kD / 64;  // chunks of minima (and of maxima) per lane
  constexpr int kSlot = kQuest8 ? kChunks : 2 * kChunks;  // 16-byte slots a lane fills per pass
  constexpr int kValues = 2 * kHeads;                     // centre then spread, per head
  constexpr int kHeld = kValues / 8;  // totals a lane holds after the octet's sum
  unsigned pending = __ballot_sync(kFullWarp, rec != nullptr);
  const auto address = reinterpret_cast<unsigned long long>(rec);
  const int octet = lane / 8, j = lane % 8;
  float4* slots = reinterpret_cast<float4*>(ring);  // [stage][kSlot][32 lanes]
  // Per pass queued, 8 bits, oldest lowest: bit 7 the octet has a record, bits
  // 0-6 the index + 1 of the lane's own record in the pass (0: none).
  unsigned queue = 0;
  int issued = 0;
  auto issue = [&](int queued) {
    if (pending != 0) {
      int src = -1, mine = -1;
#pragma unroll
      for (int k = 0; k < kOctetRecords; ++k) {  // the pass: the next 4 records in lane order
        const int s = pending != 0 ? __ffs(pending) - 1 : -1;
        if (k == octet) src = s;
        if (s == lane) mine = k;
        pending &= pending - 1;
      }
      const auto* r = reinterpret_cast<const float*>(__shfl_sync(kFullWarp, address, max(src, 0)));
      float4* slot = slots + (issued % kOctetStages) * kSlot * 32 + lane;
      if (src >= 0) {
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          if constexpr (kQuest8) {  // channels 8(j + 8c) …: bytes of the min run, of the max run
            const char* codes = reinterpret_cast<const char*>(r + o.quest8) + 8 * (j + 8 * c);
            char* dst = reinterpret_cast<char*>(slot + c * 32);
            __pipeline_memcpy_async(dst, codes, 8);
            __pipeline_memcpy_async(dst + 8, codes + kD, 8);
          } else {
            __pipeline_memcpy_async(slot + c * 32, r + o.quest_min + 4 * (j + 8 * c), 16);
            __pipeline_memcpy_async(slot + (kChunks + c) * 32, r + o.quest_max + 4 * (j + 8 * c),
                                    16);
          }
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
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        float sum[8], width2[8];
        if constexpr (kQuest8) {
          const float4 both = slot[c * 32];
          const int8_t* lo = reinterpret_cast<const int8_t*>(&both);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int l = lo[i], u = lo[8 + i];
            sum[i] = static_cast<float>(l + u);
            const float w = static_cast<float>(u - l);
            width2[i] = w * w;
          }
        } else {
          const float4 lo4 = slot[c * 32], hi4 = slot[(kChunks + c) * 32];
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
        const int channel = OctetQueryIndex(8 * (j + 8 * c));
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          const int at = (h < heads ? h : 0) * OctetQueryStride(kD) + channel;
          const float4 c0 = *reinterpret_cast<const float4*>(qc + at);
          const float4 c1 = *reinterpret_cast<const float4*>(qc + at + 4);
          const float4 s0 = *reinterpret_cast<const float4*>(qs + at);
          const float4 s1 = *reinterpret_cast<const float4*>(qs + at + 4);
          const float cq[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
          const float sq[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            acc[h] = fmaf(cq[i], sum[i], acc[h]);
            acc[kHeads + h] = fmaf(sq[i], width2[i], acc[kHeads + h]);
          }
        }
      }
    }
    float held[kHeld];
    OctetTransposeSum<kValues>(acc, lane, held);
    // Value v of record k sits in lane 8k + v / kHeld, at held[v % kHeld].
    const int base = 8 * max(mine, 0);
#pragma unroll
    for (int v = 0; v < kValues; ++v) {
      const float total = __shfl_sync(kFullWarp, held[v % kHeld], base + v / kHeld);
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
