// Sparse paged decode attention (paged_attention.h): the host half. Checks the
// arguments, plans the launch (kernel variant, split count) and launches the kernels
// of decode_kernels.cuh; docs/benchmarks/attention.md has the measurements behind the
// choices.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gpu/attention/decode_kernels.cuh"
#include "gpu/attention/decode_mma.cuh"
#include "gpu/attention/paged_attention.h"
#include "gpu/attention/params_check.h"
#include "gpu/launch.cuh"

namespace eps::attention {
namespace {

// EPS_ATTN_ECUDA for a failed CUDA call `what`, its error also cleared as the thread's
// last error: left there, the next launch check on this thread (of this library's own
// cudart) would report it as its own.
int32_t FailCuda(const char* what, cudaError_t e) {
  (void)cudaGetLastError();
  return Fail(EPS_ATTN_ECUDA, std::string(what) + ": " + cudaGetErrorString(e));
}

// Multiprocessor count of the current device, read once per device.
int32_t SmCount(int* sms) {
  static std::mutex mu;
  static std::vector<int> cache;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    return FailCuda("cudaGetDevice", e);
  }
  std::lock_guard<std::mutex> lock(mu);
  if (device >= static_cast<int>(cache.size())) cache.resize(device + 1, 0);
  if (cache[device] == 0) {
    cudaError_t e = cudaDeviceGetAttribute(&cache[device], cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess) {
      return FailCuda("cudaDeviceGetAttribute(MultiProcessorCount)", e);
    }
  }
  *sms = cache[device];
  return EPS_ATTN_OK;
}

// The variants EPS_ATTN_VARIANT names (private, for benchmarks), read once per process:
// `small` runs when one warp per unit cannot fill half the GPU, `large` otherwise.
struct VariantChoice {
  KernelVariant small;
  KernelVariant large;
};

int32_t ChooseVariant(VariantChoice* choice) {
  static const std::string chosen = [] {
    const char* env = std::getenv("EPS_ATTN_VARIANT");
    return std::string(env == nullptr ? "" : env);
  }();
  using V = KernelVariant;
  static const struct {
    const char* name;
    VariantChoice choice;
  } kNames[] = {{"", {V::kCtaKvInner, V::kWarpMma}},
                {"auto", {V::kCtaKvInner, V::kWarpMma}},
                {"auto_lean", {V::kCtaKvInner, V::kWarpLean}},
                {"auto_pipe", {V::kCtaKvInner, V::kWarpPipe}},
                {"cta", {V::kCtaSplitInner, V::kCtaSplitInner}},
                {"cta_kv_inner", {V::kCtaKvInner, V::kCtaKvInner}},
                {"warp_lean", {V::kWarpLean, V::kWarpLean}},
                {"warp_pipe", {V::kWarpPipe, V::kWarpPipe}},
                {"warp_mma", {V::kWarpMma, V::kWarpMma}}};
  for (const auto& n : kNames) {
    if (chosen == n.name) {
      *choice = n.choice;
      return EPS_ATTN_OK;
    }
  }
  return Fail(EPS_ATTN_EINVAL, "EPS_ATTN_VARIANT=" + chosen +
                                   " is not one of auto, auto_lean, auto_pipe, cta, "
                                   "cta_kv_inner, warp_lean, warp_pipe, warp_mma");
}

bool IsWarpUnit(KernelVariant v) {
  return v == KernelVariant::kWarpLean || v == KernelVariant::kWarpPipe ||
         v == KernelVariant::kWarpMma;
}

using SplitFn = void (*)(EpsAttnParams, Plan);

// The SplitKernel instance of (dtype, head_dim, gt, variant): the one place that maps
// a plan to a kernel, for the launch and for its occupancy.
template <typename T, int D, int GT>
SplitFn SplitKernelFor(KernelVariant v, bool feedback) {
  switch (v) {
    case KernelVariant::kWarpLean:
      return SplitKernel<T, D, GT, true, true, false>;
    case KernelVariant::kWarpPipe:
      return SplitKernel<T, D, GT, true, true, true>;
    case KernelVariant::kWarpMma:  // every group size: heads padded to the mma's 8
      return feedback ? MmaSplitKernel<T, D, true> : MmaSplitKernel<T, D, false>;
    default:
      return SplitKernel<T, D, GT, false, false, false>;
  }
}

template <typename T, int D>
SplitFn SplitKernelFor(int gt, KernelVariant v, bool feedback) {
  switch (gt) {
    case 1:
      return SplitKernelFor<T, D, 1>(v, feedback);
    case 2:
      return SplitKernelFor<T, D, 2>(v, feedback);
    case 4:
      return SplitKernelFor<T, D, 4>(v, feedback);
    default:
      return SplitKernelFor<T, D, 8>(v, feedback);
  }
}

template <typename T>
SplitFn SplitKernelFor(int head_dim, int gt, KernelVariant v, bool feedback) {
  switch (head_dim) {
    case 64:
      return SplitKernelFor<T, 64>(gt, v, feedback);
    case 128:
      return SplitKernelFor<T, 128>(gt, v, feedback);
    default:
      return SplitKernelFor<T, 256>(gt, v, feedback);
  }
}

SplitFn SplitKernelFor(const EpsAttnParams& p, int gt, KernelVariant v) {
  const bool feedback = p.feedback != nullptr;
  return p.dtype == EPS_ATTN_BF16 ? SplitKernelFor<__nv_bfloat16>(p.head_dim, gt, v, feedback)
                                  : SplitKernelFor<__half>(p.head_dim, gt, v, feedback);
}

// CTAs of `kernel` that fit on an SM of the current device, read once per (device,
// kernel).
int32_t CtasPerSm(SplitFn kernel, int* ctas) {
  static std::mutex mu;
  static std::map<std::pair<int, SplitFn>, int> cache;
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    return FailCuda("cudaGetDevice", e);
  }
  std::lock_guard<std::mutex> lock(mu);
  auto [it, inserted] = cache.try_emplace({device, kernel}, 0);
  if (inserted) {
    const cudaError_t e =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&it->second, kernel, kThreads, 0);
    if (e != cudaSuccess || it->second < 1) {
      cache.erase(it);
      return FailCuda("cudaOccupancyMaxActiveBlocksPerMultiprocessor", e);
    }
  }
  *ctas = it->second;
  return EPS_ATTN_OK;
}

// Splits per (row, KV head, head group) when the caller leaves it to us: the fewest
// whose last wave of CTAs is at least kWaveFill as full as the best split count's
// (flash-decoding's wave-efficiency rule), with no split under kMinChunk list entries,
// where the partials would cost more than they spread. Fewer splits mean longer runs
// per unit and less to combine; a full last wave means no SM idles at the end.
constexpr int64_t kMinChunk = 8;
constexpr double kWaveFill = 0.9;

int64_t WaveSplits(int64_t rows, int64_t width, int64_t units_per_cta, int64_t cta_slots) {
  const int64_t max_splits =
      std::max<int64_t>(1, std::min<int64_t>((width + kMinChunk - 1) / kMinChunk, 1024));
  auto fill = [&](int64_t splits) {
    const double ctas = static_cast<double>((rows * splits + units_per_cta - 1) / units_per_cta);
    const double waves = ctas / static_cast<double>(cta_slots);
    return waves / std::ceil(waves);
  };
  double best = 0.0;
  for (int64_t s = 1; s <= max_splits; ++s) best = std::max(best, fill(s));
  for (int64_t s = 1; s <= max_splits; ++s) {
    if (fill(s) >= kWaveFill * best) return s;
  }
  return max_splits;
}

// The launch shape. The split count follows the list width (the counts live on the
// device); each row's chunk follows its count (SplitChunk), so a short list in a wide
// buffer still uses every split, and passing epsd's full-width visit_blocks costs
// about what a sliced one does.
int32_t MakePlan(const EpsAttnParams& p, Plan* plan) {
  VariantChoice choice;
  if (int32_t code = ChooseVariant(&choice); code != EPS_ATTN_OK) return code;
  // Selection feedback is written by the tensor-core unit only (decode_mma.cuh).
  if (p.feedback != nullptr) choice = {KernelVariant::kWarpMma, KernelVariant::kWarpMma};
  const int group = p.num_q_heads / p.num_kv_heads;
  plan->gt = group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8;
  plan->head_groups = (group + plan->gt - 1) / plan->gt;
  const int64_t width = p.length_kind == EPS_ATTN_VISIT_COUNT
                            ? std::max(p.max_list_blocks, p.dense_max_blocks)
                            : p.max_list_blocks;
  const int64_t rows = int64_t{p.batch} * p.num_kv_heads * plan->head_groups;
  int sms = 0;
  if (int32_t code = SmCount(&sms); code != EPS_ATTN_OK) return code;
  // cta_slots: CTAs of the variant that run at once on the device.
  auto slots = [&](KernelVariant v, int64_t* cta_slots) {
    int ctas = 0;
    const int32_t code = CtasPerSm(SplitKernelFor(p, plan->gt, v), &ctas);
    *cta_slots = int64_t{ctas} * sms;
    return code;
  };
  plan->variant = choice.large;
  int64_t cta_slots = 0;
  if (int32_t code = slots(plan->variant, &cta_slots); code != EPS_ATTN_OK) return code;
  const int64_t max_units = rows * ((width + kMinChunk - 1) / kMinChunk);
  if (IsWarpUnit(plan->variant) && 2 * max_units < cta_slots * kWarps) {
    plan->variant = choice.small;  // warps would leave most of the GPU idle
    if (int32_t code = slots(plan->variant, &cta_slots); code != EPS_ATTN_OK) return code;
  }
  const int64_t units_per_cta = IsWarpUnit(plan->variant) ? kWarps : 1;
  int64_t splits;
  if (p.num_splits > 0) {
    splits = std::min<int64_t>(p.num_splits, width);
    plan->min_chunk = 1;
  } else {
    splits = WaveSplits(rows, width, units_per_cta, cta_slots);
    plan->min_chunk = static_cast<int>(kMinChunk);
  }
  plan->splits = static_cast<int>(std::max<int64_t>(splits, 1));
  if (int64_t{p.batch} * p.num_q_heads > INT32_MAX) {  // CombineKernel's grid
    return Fail(EPS_ATTN_EINVAL,
                "batch * num_q_heads = " + std::to_string(int64_t{p.batch} * p.num_q_heads) +
                    " is too many rows for one launch");
  }
  if (rows * plan->splits > INT32_MAX) {
    return Fail(EPS_ATTN_EINVAL, "batch * num_kv_heads * splits = " +
                                     std::to_string(rows * plan->splits) + " units is too many");
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

template <typename T, int D>
cudaError_t LaunchCombine(const EpsAttnParams& p, const Plan& plan, cudaStream_t stream) {
  const unsigned combines = static_cast<unsigned>(int64_t{p.batch} * p.num_q_heads);
  return eps::gpu::LaunchKernel(CombineKernel<T, D>, combines, D, 0, stream, p, plan);
}

template <typename T>
cudaError_t LaunchCombine(const EpsAttnParams& p, const Plan& plan, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64:
      return LaunchCombine<T, 64>(p, plan, stream);
    case 128:
      return LaunchCombine<T, 128>(p, plan, stream);
    default:
      return LaunchCombine<T, 256>(p, plan, stream);
  }
}

cudaError_t Launch(const EpsAttnParams& p, const Plan& plan, cudaStream_t stream) {
  const int64_t units = int64_t{p.batch} * p.num_kv_heads * plan.head_groups * plan.splits;
  const int64_t ctas = IsWarpUnit(plan.variant) ? (units + kWarps - 1) / kWarps : units;
  if (cudaError_t e =
          eps::gpu::LaunchKernel(SplitKernelFor(p, plan.gt, plan.variant),
                                 static_cast<unsigned>(ctas), kThreads, 0, stream, p, plan);
      e != cudaSuccess || plan.splits == 1) {
    return e;
  }
  return p.dtype == EPS_ATTN_BF16 ? LaunchCombine<__nv_bfloat16>(p, plan, stream)
                                  : LaunchCombine<__half>(p, plan, stream);
}

// positions[table[b, j]] = j over each row's blocks (eps_attn_block_positions).
__global__ void BlockPositionsKernel(const int32_t* table, int64_t stride, const int32_t* lengths,
                                     int32_t batch, int32_t block_size, int32_t num_blocks,
                                     int64_t width, int32_t* positions) {
  const int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (i >= int64_t{batch} * width) return;
  const int64_t b = i / width;
  const int64_t j = i % width;
  const int64_t blocks = (int64_t{lengths[b]} + block_size - 1) / block_size;
  if (j >= blocks) return;
  const int32_t id = table[b * stride + j];
  if (id >= 0 && id < num_blocks) positions[id] = static_cast<int32_t>(j);
}

}  // namespace
}  // namespace eps::attention

using eps::attention::CheckParams;
using eps::attention::Fail;
using eps::attention::FailCuda;
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
  const cudaError_t e = eps::attention::Launch(p, plan, s);
  if (e != cudaSuccess) {
    return FailCuda("kernel launch", e);
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
    return FailCuda("reading error_word", e);
  }
  if (word[0] == 0) return Succeed();
  return Fail(EPS_ATTN_ELIST, eps::attention::DescribeListError(word));
}

extern "C" int32_t eps_attn_block_positions(const int32_t* table, int64_t table_stride_row,
                                            int32_t table_width, const int32_t* lengths,
                                            int32_t batch, int32_t block_size, int32_t num_blocks,
                                            int32_t* positions, void* stream) {
  if (table == nullptr || lengths == nullptr || positions == nullptr) {
    return Fail(EPS_ATTN_EINVAL, "table, lengths or positions is NULL");
  }
  if (batch < 0 || block_size < 1 || num_blocks < 1 || table_width < 1 ||
      table_stride_row < table_width) {
    return Fail(EPS_ATTN_EINVAL, "batch=" + std::to_string(batch) +
                                     ", block_size=" + std::to_string(block_size) +
                                     ", num_blocks=" + std::to_string(num_blocks) +
                                     ", table_stride_row=" + std::to_string(table_stride_row) +
                                     ", table_width=" + std::to_string(table_width) +
                                     ": need batch >= 0, the others >= 1 and the stride >= "
                                     "the width");
  }
  if (batch == 0) return Succeed();
  const int64_t width = table_width;
  const int64_t threads = int64_t{batch} * width;
  constexpr int kBlock = 256;
  const auto s = static_cast<cudaStream_t>(stream);
  if (cudaError_t e = eps::gpu::LaunchKernel(eps::attention::BlockPositionsKernel,
                                             static_cast<unsigned>((threads + kBlock - 1) / kBlock),
                                             kBlock, 0, s, table, table_stride_row, lengths, batch,
                                             block_size, num_blocks, width, positions);
      e != cudaSuccess) {
    return FailCuda("block positions launch", e);
  }
  return Succeed();
}
