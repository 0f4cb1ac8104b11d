// Warp-level tensor-core instructions for decode_mma.cuh, one wrapper each: the 16x8x16
// matrix multiply-accumulate with float32 accumulators and the 8x8 16-bit transpose
// between lanes. Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with
// g = lane / 4 and t = lane % 4, two 16-bit elements per 32-bit register, the lower
// column (or row, for B) in the low half:
//   A (16x16, row-major): a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1],
//                         a[2] = A[g][2t+8, 2t+9], a[3] = A[g+8][2t+8, 2t+9]
//   B (16x8, column):     b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]
//   C (16x8, float32):    c[0], c[1] = C[g][2t, 2t+1], c[2], c[3] = C[g+8][2t, 2t+1]
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace eps::attention {

// c += A * B over one 16x8x16 tile; T is __nv_bfloat16 or __half (A and B alike).
template <typename T>
__device__ __forceinline__ void MmaM16N8K16(float (&c)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  __trap();  // the library is built for sm_90 (CMAKE_CUDA_ARCHITECTURES); mma needs sm_80
#endif
}

// The transpose of an 8x8 matrix of 16-bit elements held one row fragment per lane
// (lane holds X[lane / 4][2 * (lane % 4) + {0, 1}]); returns the same fragment of Xᵀ.
__device__ __forceinline__ uint32_t TransposeM8N8(uint32_t x) {
  uint32_t y;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
#else
  y = x;
  __trap();
#endif
  return y;
}

// Two floats rounded to T, `lo` in the low half (the lower index of a fragment pair).
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

}  // namespace eps::attention
