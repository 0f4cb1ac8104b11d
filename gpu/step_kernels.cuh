// The kernels of one decode step's GPU pre-pass (gpu/step.h says what each
// stage does). Included by gpu/step.cu only; shapes in comments, the launch
// configuration is computed there.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/half.h"
#include "gpu/phi.cuh"

namespace eps::gpu::kernels {


// The first error a kernel meets; the host turns it into a status.
enum ErrorCode : int { kOk = 0, kBadSlot = 1, kBadBlock = 2, kBadScore = 3, kBadQuery = 4 };
struct DeviceStatus {
  int code;
  int row, index, value;
};
// Step counters, summed with atomics.
struct DeviceStats {
  unsigned long long groups_visited, blocks_visited, visited_tokens;
};
struct DeviceRow {
  int64_t table_row;
  int64_t context_tokens;
};

__device__ void Fail(DeviceStatus* status, int code, int row, int index, int value) {
  if (atomicCAS(&status->code, kOk, code) == kOk) {
    status->row = row;
    status->index = index;
    status->value = value;
  }
}

struct Shape {
  int layers, q_heads, kv_heads, d, m, packed, record_words, block_size, group_blocks;
  int fro2, max_norm, count, key_sum, quest_min, quest_max, principal;
  int64_t max_batch, max_seqs, max_groups, max_blocks, num_slots, num_physical_blocks;
  int query_dtype, method;
  int lists;  // visit lists per (layer, row): 1 (union) or kv_heads (per KV head)
};

// Query terms [batch, layers, q_heads, packed + 1]: packed z zᵀ (off-diagonal
// doubled), then ‖q‖. One warp per (row, layer, q head); lanes split the d
// dimension and reduce with shuffles.
__global__ void QueryTermsKernel(Shape s, const void* queries, const float* phi, int warps,
                                 float* terms, DeviceStatus* status) {
  __shared__ float z_shared[8][64];
  const int warp_in_block = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp = blockIdx.x * (blockDim.x / 32) + warp_in_block;
  if (warp >= warps) return;
  const int h = warp % s.q_heads;
  const int layer = (warp / s.q_heads) % s.layers;
  const int row = warp / (s.q_heads * s.layers);
  const int kvh = h / (s.q_heads / s.kv_heads);
  const int64_t base = ((int64_t{layer} * s.max_batch + row) * s.q_heads + h) * s.d;
  const float* matrix = phi + (int64_t{layer} * s.kv_heads + kvh) * s.d * s.m;
  float* z = z_shared[warp_in_block];
  float n2 = 0.0f;
  for (int j = 0; j < s.m; ++j) {
    float partial = 0.0f;
    for (int i = lane; i < s.d; i += 32) {
      const float qi = LoadAsFloatDevice(queries, s.query_dtype, base + i);
      partial += matrix[i * s.m + j] * qi;
      if (j == 0) {
        n2 += qi * qi;
        if (!isfinite(qi)) Fail(status, kBadQuery, row, (layer * s.q_heads + h) * s.d + i, 0);
      }
    }
    for (int offset = 16; offset > 0; offset /= 2) partial += __shfl_xor_sync(0xFFFFFFFFu, partial, offset);
    if (lane == 0) z[j] = partial;
  }
  for (int offset = 16; offset > 0; offset /= 2) n2 += __shfl_xor_sync(0xFFFFFFFFu, n2, offset);
  __syncwarp();
  float* out = terms + ((int64_t{row} * s.layers + layer) * s.q_heads + h) * (s.packed + 1);
  for (int i = 0, p = 0; i < s.m; ++i) {
    for (int j = i; j < s.m; ++j, ++p) {
      if (p % 32 == lane) out[p] = (i == j ? 1.0f : 2.0f) * z[i] * z[j];
    }
  }
  if (lane == 0) out[s.packed] = sqrtf(n2);
}

__device__ float FroScore(const float* rec, const Shape& s, float qnorm) {
  return qnorm * sqrtf(fmaxf(rec[s.fro2], 0.0f));
}

// Scores [batch, layers, q_heads, max_groups]. Grid (group chunks, layers*kv_heads, rows).
// kM > 0 fixes m at compile time: the packed Gram is then read once into
// registers with unrolled 16-byte loads and reused for every query head of the
// KV head (GQA), instead of being re-read per head.
template <int kM>
__global__ void ScoreKernel(Shape s, const float* pool, const int32_t* group_table,
                            const int32_t* block_table, const void* queries, const DeviceRow* rows,
                            const float* terms, const uint8_t* scored, float* scores,
                            DeviceStatus* status) {
  const int row = blockIdx.z;
  const int layer = blockIdx.y / s.kv_heads, kvh = blockIdx.y % s.kv_heads;
  const int ratio = s.q_heads / s.kv_heads;
  const int64_t tokens = rows[row].context_tokens;
  const int64_t nb = (tokens + s.block_size - 1) / s.block_size;
  const int64_t n = (nb + s.group_blocks - 1) / s.group_blocks;
  const int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (p >= n) return;
  const int64_t table_row = rows[row].table_row;
  // Block ids are checked once per group, by the (layer 0, kv head 0) blocks.
  if (blockIdx.y == 0) {
    for (int64_t b = p * s.group_blocks; b < min(nb, (p + 1) * s.group_blocks); ++b) {
      const int32_t id = block_table[table_row * s.max_blocks + b];
      if (id < 0 || (s.num_physical_blocks >= 0 && id >= s.num_physical_blocks)) {
        Fail(status, kBadBlock, row, static_cast<int>(b), id);
      }
    }
  }
  const int32_t slot = group_table[table_row * s.max_groups + p];
  if (slot < 0 || slot >= s.num_slots) {
    Fail(status, kBadSlot, row, static_cast<int>(p), slot);
    return;  // never read outside the pool
  }
  const float* rec =
      pool + ((int64_t{slot} * s.layers + layer) * s.kv_heads + kvh) * s.record_words;
  const bool stats_ok = isfinite(rec[s.fro2]) && isfinite(rec[s.max_norm]) && isfinite(rec[s.count]);
  constexpr int kPacked = kM * (kM + 1) / 2;
  constexpr int kVectors = (kPacked + 3) / 4;  // the record is 16-byte aligned and padded
  float4 gram[kM > 0 ? kVectors : 1];
  if constexpr (kM > 0) {
    if (s.method == 1) {
#pragma unroll
      for (int v = 0; v < kVectors; ++v) gram[v] = reinterpret_cast<const float4*>(rec)[v];
    }
  }
  for (int r = 0; r < ratio; ++r) {
    const int h = kvh * ratio + r;
    if (scored != nullptr && !scored[layer * s.q_heads + h]) continue;
    const float* t = terms + ((int64_t{row} * s.layers + layer) * s.q_heads + h) * (s.packed + 1);
    const float qnorm = t[s.packed];
    float score = 0.0f;
    switch (s.method) {
      case 1: {  // jl: the record is 16-byte aligned, so read it 4 words at a time
        float quad = 0.0f;
        if constexpr (kM > 0) {
          const float* g = reinterpret_cast<const float*>(gram);
#pragma unroll
          for (int w = 0; w < kPacked; ++w) quad += g[w] * t[w];
          score = sqrtf(fmaxf(quad, 0.0f));
          if (isnan(quad)) score = quad;
          break;
        }
        int w = 0;
        for (; w + 4 <= s.packed; w += 4) {
          const float4 g4 = *reinterpret_cast<const float4*>(rec + w);
          quad += g4.x * t[w] + g4.y * t[w + 1] + g4.z * t[w + 2] + g4.w * t[w + 3];
        }
        for (; w < s.packed; ++w) quad += rec[w] * t[w];
        score = sqrtf(fmaxf(quad, 0.0f));
        if (isnan(quad)) score = quad;
        break;
      }
      case 2: {  // 1pc (falls back to fro when absent or unsealed)
        score = FroScore(rec, s, qnorm);
        if (s.principal < 0 || rec[s.principal + 2] == 0.0f) break;
        const int64_t qbase = ((int64_t{layer} * s.max_batch + row) * s.q_heads + h) * s.d;
        const int8_t* u = reinterpret_cast<const int8_t*>(rec + s.principal + 3);
        float dot = 0.0f;
        for (int i = 0; i < s.d; ++i) dot += static_cast<float>(u[i]) * LoadAsFloatDevice(queries, s.query_dtype, qbase + i);
        const float along = fabsf(dot * rec[s.principal + 2]);
        const float q2 = qnorm * qnorm;
        const float perp = sqrtf(fmaxf(q2 - along * along, 0.0f) + ldexpf(static_cast<float>(s.d), -22) * q2);
        const float fro2 = fmaxf(rec[s.fro2], 0.0f);
        const float pad = ldexpf(rec[s.count] + static_cast<float>(s.d), -22) * fro2;
        score = fminf(sqrtf(fmaxf(rec[s.principal], 0.0f)) * along +
                          sqrtf(fmaxf(rec[s.principal + 1], 0.0f) + pad) * perp,
                      score);
        break;
      }
      case 3:  // fro
        score = FroScore(rec, s, qnorm);
        break;
      case 4: {  // quest
        if (s.quest_min < 0) {
          score = FroScore(rec, s, qnorm);
          break;
        }
        if (rec[s.count] <= 0.0f) {
          score = -INFINITY;
          break;
        }
        const int64_t qbase = ((int64_t{layer} * s.max_batch + row) * s.q_heads + h) * s.d;
        float sum = 0.0f;
        for (int i = 0; i < s.d; ++i) {
          const float qi = LoadAsFloatDevice(queries, s.query_dtype, qbase + i);
          sum += fmaxf(qi * rec[s.quest_min + i], qi * rec[s.quest_max + i]);
        }
        score = sum;
        break;
      }
      default:
        break;
    }
    if (isnan(score) || score == INFINITY || !stats_ok) {
      Fail(status, kBadScore, row, static_cast<int>(p), slot);
    }
    scores[((int64_t{row} * s.layers + layer) * s.q_heads + h) * s.max_groups + p] = score;
  }
}

// Float -> unsigned key with the same order.
__device__ unsigned OrderedKey(float f) {
  const unsigned bits = __float_as_uint(f);
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}
__device__ float KeyToFloat(unsigned key) {
  return __uint_as_float((key & 0x80000000u) ? key & 0x7FFFFFFFu : ~key);
}

__device__ bool IsForced(int p, int n, int first_n, int last_n) {
  return p < first_n || p >= n - last_n || p == n - 1;
}

// One warp per (row, layer, q head): the top_pages-th largest score among the
// unforced groups by exact bitwise radix select (32 passes of a warp-wide
// count), then the threshold T/α (T·α when T ≤ 0). Unscored heads get +inf
// (they add nothing); heads with at most top_pages unforced groups get -inf.
__global__ void ThresholdKernel(Shape s, float alpha, int first_n, int last_n, int top_pages,
                                int warps, const DeviceRow* rows, const uint8_t* scored,
                                const float* scores, float* thresholds,
                                const DeviceStatus* status) {
  __shared__ unsigned histograms[8][256];
  const int warp = static_cast<int>((blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / 32);
  const int lane = threadIdx.x % 32;
  if (warp >= warps || status->code != kOk) return;
  const int h = warp % s.q_heads;
  const int layer = (warp / s.q_heads) % s.layers;
  const int row = warp / (s.q_heads * s.layers);
  if (scored != nullptr && !scored[layer * s.q_heads + h]) {
    if (lane == 0) thresholds[warp] = INFINITY;
    return;
  }
  const int64_t tokens = rows[row].context_tokens;
  const int64_t nb = (tokens + s.block_size - 1) / s.block_size;
  const int n = static_cast<int>((nb + s.group_blocks - 1) / s.group_blocks);
  const float* sc = scores + ((int64_t{row} * s.layers + layer) * s.q_heads + h) * s.max_groups;
  unsigned local = 0;
  for (int p = lane; p < n; p += 32) local += !IsForced(p, n, first_n, last_n);
  const unsigned unforced = __reduce_add_sync(0xFFFFFFFFu, local);
  float threshold = -INFINITY;
  if (unforced > static_cast<unsigned>(top_pages)) {
    // 8 bits at a time: a 256-bin histogram of the keys that share the prefix
    // found so far, then the bin where the count from the top reaches k.
    unsigned* histogram = histograms[threadIdx.x / 32];
    unsigned prefix = 0, prefix_mask = 0, k = static_cast<unsigned>(top_pages);
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = lane; b < 256; b += 32) histogram[b] = 0;
      __syncwarp();
      for (int p = lane; p < n; p += 32) {
        const unsigned key = OrderedKey(sc[p]);
        if (!IsForced(p, n, first_n, last_n) && (key & prefix_mask) == prefix) {
          atomicAdd(&histogram[(key >> shift) & 0xFFu], 1u);
        }
      }
      __syncwarp();
      // Lane 0 walks the bins from the top until the count reaches k.
      int chosen = -1;
      unsigned before = 0;
      if (lane == 0) {
        unsigned acc = 0;
        for (int b = 255; b >= 0; --b) {
          if (acc + histogram[b] >= k) {
            chosen = b;
            before = acc;
            break;
          }
          acc += histogram[b];
        }
      }
      chosen = __shfl_sync(0xFFFFFFFFu, chosen, 0);
      before = __shfl_sync(0xFFFFFFFFu, before, 0);
      prefix |= static_cast<unsigned>(chosen) << shift;
      prefix_mask |= 0xFFu << shift;
      k -= before;
      __syncwarp();
    }
    const float t = KeyToFloat(prefix);
    threshold = t > 0.0f ? t / alpha : t * alpha;
  }
  if (lane == 0) thresholds[warp] = threshold;
}

// Per (layer, row): the union over heads of groups at or above their head's
// threshold, plus forced groups, compacted into visit_blocks / visit_count.
__global__ void SelectKernel(Shape s, int first_n, int last_n, int method_off,
                             const int32_t* block_table, const DeviceRow* rows,
                             const float* scores, const float* thresholds, int32_t* visit_blocks,
                             int32_t* visit_count, const DeviceStatus* status,
                             DeviceStats* stats, const uint64_t* selection_done, uint64_t step) {
  extern __shared__ unsigned char visit[];
  __shared__ float head_threshold[256];
  __shared__ unsigned counts[256];
  // blockIdx.x = layer * lists + list; a list unions the query heads of one KV
  // head (per-KV-head output) or of all of them (union).
  const int layer = blockIdx.x / s.lists, list = blockIdx.x % s.lists, row = blockIdx.y;
  const int64_t list_index = (int64_t{layer} * s.max_batch + row) * s.lists + list;
  // The engine gave up on this step (its client released selection_done and
  // attends densely): leave its outputs alone.
  if (selection_done != nullptr && *reinterpret_cast<const volatile uint64_t*>(selection_done) >= step) {
    return;
  }
  if (status->code != kOk) {
    // An earlier kernel failed: no list is computed. With a step fence the
    // engine's stream proceeds on selection_done regardless, so each list of
    // the step says "attend densely" (-1); without one, nothing is written.
    if (selection_done != nullptr && threadIdx.x == 0) visit_count[list_index] = -1;
    return;
  }
  const int heads_per_list = s.q_heads / s.lists, first_head = list * heads_per_list;
  const int64_t tokens = rows[row].context_tokens;
  const int64_t nb = (tokens + s.block_size - 1) / s.block_size;
  const int n = static_cast<int>((nb + s.group_blocks - 1) / s.group_blocks);
  const int64_t head_base = (int64_t{row} * s.layers + layer) * s.q_heads;
  for (int h = threadIdx.x; h < s.q_heads && !method_off; h += blockDim.x) {
    head_threshold[h] = thresholds[head_base + h];
  }
  __syncthreads();
  for (int p = threadIdx.x; p < n; p += blockDim.x) {
    bool v = method_off || IsForced(p, n, first_n, last_n);
    for (int h = first_head; h < first_head + heads_per_list && !v; ++h) {
      v = scores[(head_base + h) * s.max_groups + p] >= head_threshold[h];
    }
    visit[p] = v;
  }
  __syncthreads();
  // Compaction. Per-group output offsets by a block-wide scan over contiguous
  // chunks, then one thread per output element: it finds its group by binary
  // search over the offsets, so block-table reads and visit-list writes are
  // coalesced across the warp.
  unsigned* offset = reinterpret_cast<unsigned*>(visit + ((s.max_groups + 15) / 16) * 16);
  const int chunk = (n + blockDim.x - 1) / blockDim.x;
  const int begin = min(n, static_cast<int>(threadIdx.x) * chunk), end = min(n, begin + chunk);
  unsigned mine = 0, groups = 0;
  for (int p = begin; p < end; ++p) {
    if (visit[p]) {
      mine += static_cast<unsigned>(min(nb, int64_t{p + 1} * s.group_blocks) - int64_t{p} * s.group_blocks);
      ++groups;
    }
  }
  counts[threadIdx.x] = mine;
  __syncthreads();
  for (int stride = 1; stride < blockDim.x; stride *= 2) {  // inclusive scan
    const unsigned add = threadIdx.x >= stride ? counts[threadIdx.x - stride] : 0;
    __syncthreads();
    counts[threadIdx.x] += add;
    __syncthreads();
  }
  unsigned at = counts[threadIdx.x] - mine;
  for (int p = begin; p < end; ++p) {
    offset[p] = at;
    if (visit[p]) at += static_cast<unsigned>(min(nb, int64_t{p + 1} * s.group_blocks) - int64_t{p} * s.group_blocks);
  }
  __syncthreads();
  const unsigned total = counts[blockDim.x - 1];
  const int64_t table_row = rows[row].table_row;
  const int64_t out = list_index * s.max_blocks;
  for (unsigned o = threadIdx.x; o < total; o += blockDim.x) {
    int lo = 0, hi = n;  // first group whose offset exceeds o
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (offset[mid] <= o) lo = mid + 1; else hi = mid;
    }
    const int p = lo - 1;  // visited: an empty group's offset equals the next one's
    visit_blocks[out + o] = block_table[table_row * s.max_blocks + int64_t{p} * s.group_blocks + (o - offset[p])];
  }
  // One atomic per warp: 262K same-address atomics per step cost hundreds of µs.
  const unsigned warp_groups = __reduce_add_sync(0xFFFFFFFFu, groups);
  if (threadIdx.x % 32 == 0 && warp_groups > 0) atomicAdd(&stats->groups_visited, warp_groups);
  if (threadIdx.x == blockDim.x - 1) {
    visit_count[list_index] = static_cast<int32_t>(total);
    atomicAdd(&stats->blocks_visited, total);
    const int64_t last = tokens - (tokens - 1) / s.block_size * s.block_size;
    atomicAdd(&stats->visited_tokens,
              static_cast<unsigned long long>(total == 0 ? 0 : (int64_t{total} - 1) * s.block_size + last));
  }
}

}  // namespace eps::gpu::kernels
