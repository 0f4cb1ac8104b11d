// The device memory a GpuSelector holds (GpuSelector::DeviceBytes), for its session's
// charge: one term per buffer GpuSelector::Allocate makes (gpu/step.cu), and the coarse
// level's two that its first step adds.
#include <cstdint>

#include "core/saturating.h"
#include "gpu/fused_select.cuh"
#include "gpu/step.h"
#include "gpu/step_shape.cuh"
#include "gpu/terms_kernel.cuh"
#include "gpu/warp_select.cuh"

namespace eps::gpu {

uint64_t GpuSelector::DeviceBytes(const ModelLayout& model, int64_t max_batch, int64_t max_groups,
                                  int64_t max_coarse_groups) {
  const uint64_t batch = max_batch, layers = model.num_layers, q_heads = model.num_q_heads,
                 kv_heads = model.num_kv_heads, groups = max_groups, coarse = max_coarse_groups,
                 f = sizeof(float);
  return SaturatingSum(
      {SaturatingProduct(
           {layers, kv_heads, uint64_t(model.head_dim), uint64_t(model.sketch_dim), f}),
       SaturatingProduct({batch, layers, q_heads, groups, f}),  // scores
       SaturatingProduct(
           {batch, layers, q_heads, uint64_t(kernels::TermWords(model.sketch_dim)), f}),
       SaturatingProduct({batch, sizeof(kernels::DeviceRow)}),
       SaturatingProduct({layers, q_heads}),  // the retrieval heads' marks
       SaturatingProduct({layers, sizeof(kernels::MassRule)}), 2 * sizeof(kernels::StepReport),
       SaturatingProduct({batch, layers, uint64_t(kernels::kFusedMaskWords), sizeof(unsigned)}),
       SaturatingProduct(
           {SaturatingSum({SaturatingProduct({batch, layers}), 1}), sizeof(unsigned)}),
       SaturatingProduct({batch, layers, q_heads, coarse, f}),  // coarse scores
       SaturatingProduct({batch, layers, kv_heads, coarse})});  // candidate flags
}

}  // namespace eps::gpu
