// Φ on the device: the same counter-based generator as core/phi.h, bit for bit
// (docs/phi.md), so kernels can build z = Φᵀq without a copy of Φ.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/half.h"
#include "core/phi.h"

namespace eps::gpu {

// core/phi.h's PhiHash is constexpr: with --expt-relaxed-constexpr the device
// calls the very same function, so there is one definition of Φ's bits.
// Φ[layer, kv_head][i][j] with index = i*m + j; `scale` is 1/sqrt(m) computed on
// the host (core PhiScale), so the device never rounds it differently.
__host__ __device__ inline float PhiElement(uint64_t seed, uint32_t layer, uint32_t kv_head,
                                            uint32_t index, float scale) {
  return (eps::PhiHash(seed, layer, kv_head, index) >> 63) ? -scale : scale;
}

// Φ for every (layer, KV head), [layers, kv_heads, d*m], as core/ lays it out.
__global__ inline void GeneratePhiKernel(uint64_t seed, int layers, int kv_heads, int per_matrix,
                                         float scale, float* phi) {
  const int64_t total = int64_t{layers} * kv_heads * per_matrix;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t matrix = e / per_matrix;
    phi[e] = PhiElement(seed, static_cast<uint32_t>(matrix / kv_heads),
                        static_cast<uint32_t>(matrix % kv_heads),
                        static_cast<uint32_t>(e % per_matrix), scale);
  }
}

// Element i of a key or query vector stored as `dtype` (a core DType), widened
// to float exactly as core/half.h does.
__device__ inline float LoadAsFloatDevice(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(data)[i]);
    case DType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]);
    default:
      return static_cast<const float*>(data)[i];
  }
}

}  // namespace eps::gpu
