#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "core/phi.h"
#include "core/status.h"
#include "core/summary.h"
#include "gpu/cuda_check.h"
#include "gpu/launch.cuh"
#include "gpu/phi.cuh"
#include "gpu/summary.h"

namespace eps::gpu {
namespace {

struct WriterShape {
  int d, m, packed, layers, kv_heads;
  int fro2, max_norm, count, key_sum, quest_min, quest_max, principal, quest8;
  DType dtype;
};

// core Quest8ScaleFor: the smallest power of two s >= 2^-149 with 127·s >= amax.
__device__ inline float Quest8ScaleFor(float amax) {
  int exponent = 0;
  frexpf(amax, &exponent);
  int e = exponent - 7;
  if (ldexpf(127.0f, e) < amax) ++e;
  return ldexpf(1.0f, max(e, -149));
}

// core FoldQuest8 for key k, channel i = lane, lane + 32, ... read by `key(i)`:
// the warp grows the record's scale to cover the key (requantizing the codes:
// floor for minima, ceil for maxima), then folds the key's codes in. The
// result is core/'s bit for bit: every step is exact.
template <typename KeyAt>
__device__ inline void FoldQuest8(float* rec, const WriterShape& s, int lane, KeyAt key) {
  int8_t* lo = reinterpret_cast<int8_t*>(rec + s.quest8);
  int8_t* hi = lo + s.d;
  float amax = 0.0f;
  for (int i = lane; i < s.d; i += 32) amax = fmaxf(amax, fabsf(key(i)));
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
  float& scale_word = rec[s.quest8 + s.d / 2];
  float scale = scale_word;
  __syncwarp();  // every lane has read the scale before lane 0 may change it
  if (amax > 127.0f * scale) {
    const float grown = Quest8ScaleFor(amax);
    if (scale > 0.0f) {
      int shift = 0;
      while (ldexpf(scale, shift) < grown) ++shift;
      for (int i = lane; i < s.d; i += 32) {
        const int l = lo[i], neg = -static_cast<int>(hi[i]);
        lo[i] = static_cast<int8_t>(shift >= 8 ? (l < 0 ? -1 : 0) : l >> shift);
        hi[i] = static_cast<int8_t>(shift >= 8 ? (neg < 0 ? 1 : 0) : -(neg >> shift));
      }
    }
    scale = grown;
    if (lane == 0) scale_word = grown;
  }
  for (int i = lane; i < s.d; i += 32) {
    // core FoldQuest8: exact (a power of two) unless below the float range, where the
    // codes follow the key's sign.
    const float k = key(i);
    const float x = scale > 0.0f ? k / scale : 0.0f;
    const int down = x != 0.0f ? static_cast<int>(floorf(x)) : (k < 0.0f ? -1 : 0);
    const int up = x != 0.0f ? static_cast<int>(ceilf(x)) : (k > 0.0f ? 1 : 0);
    lo[i] = static_cast<int8_t>(min(static_cast<int>(lo[i]), down));
    hi[i] = static_cast<int8_t>(max(static_cast<int>(hi[i]), up));
  }
}

// One warp per append. `bad` (when given) receives the lowest index of an append
// that was skipped; `skipped` (when given) counts them.
__global__ void AppendKernel(WriterShape s, const KeyAppend* appends, int n, const float* phi,
                             int* bad, unsigned long long* skipped) {
  __shared__ float y_shared[8][64];
  const int warp_in_block = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int a = blockIdx.x * (blockDim.x / 32) + warp_in_block;
  if (a >= n) return;
  const KeyAppend ap = appends[a];
  const int64_t stride = ap.stride == 0 ? s.d : ap.stride;
  // First every key is checked as core's SummaryWriter::CheckKeys does, in one pass:
  // finite, within binary16 with quest on, and the record's sums in the float range
  // (d·Σ‖k‖² < FLT_MAX, in double). Nothing of a bad append is written.
  bool finite = true;
  double squares = 0.0;
  for (int64_t t = 0; t < ap.count; ++t) {
    for (int i = lane; i < s.d; i += 32) {
      const float k = LoadAsFloatDevice(ap.keys, s.dtype, t * stride + i);
      finite &= isfinite(k) && (s.quest_min < 0 || fabsf(k) <= kHalfMax);
      squares += static_cast<double>(k) * k;
    }
  }
  for (int o = 16; o > 0; o /= 2) squares += __shfl_xor_sync(0xFFFFFFFFu, squares, o);
  squares += fmaxf(ap.record[s.fro2], 0.0f);
  finite &= squares * s.d < static_cast<double>(FLT_MAX);
  if (!__all_sync(0xFFFFFFFFu, finite)) {
    if (lane == 0 && bad != nullptr) atomicMin(bad, a);
    if (lane == 0 && skipped != nullptr) atomicAdd(skipped, 1ull);
    return;
  }
  const float* matrix = phi + (int64_t{ap.layer} * s.kv_heads + ap.kv_head) * s.d * s.m;
  float* rec = ap.record;
  float* y = y_shared[warp_in_block];
  for (int64_t t = 0; t < ap.count; ++t) {
    const int64_t base = t * stride;
    float n2 = 0.0f;
    for (int j = 0; j < s.m; ++j) {
      float partial = 0.0f;
      for (int i = lane; i < s.d; i += 32) {
        const float k = LoadAsFloatDevice(ap.keys, s.dtype, base + i);
        partial += matrix[i * s.m + j] * k;
        if (j == 0) n2 += k * k;
      }
      for (int o = 16; o > 0; o /= 2) partial += __shfl_xor_sync(0xFFFFFFFFu, partial, o);
      if (lane == 0) y[j] = partial;
    }
    for (int o = 16; o > 0; o /= 2) n2 += __shfl_xor_sync(0xFFFFFFFFu, n2, o);
    __syncwarp();
    for (int i = 0, p = 0; i < s.m; ++i) {
      for (int j = i; j < s.m; ++j, ++p) {
        if (p % 32 == lane) rec[p] += y[i] * y[j];
      }
    }
    for (int i = lane; i < s.d; i += 32) {
      const float k = LoadAsFloatDevice(ap.keys, s.dtype, base + i);
      if (s.key_sum >= 0) rec[s.key_sum + i] += k;
      if (s.quest_min >= 0) {  // binary16, rounded outward (docs/summaries.md)
        __half* lo = reinterpret_cast<__half*>(rec + s.quest_min);
        __half* hi = reinterpret_cast<__half*>(rec + s.quest_max);
        if (k < __half2float(lo[i])) lo[i] = __float2half_rd(k);
        if (k > __half2float(hi[i])) hi[i] = __float2half_ru(k);
      }
    }
    if (s.quest8 >= 0) {
      FoldQuest8(rec, s, lane,
                 [&](int i) { return LoadAsFloatDevice(ap.keys, s.dtype, base + i); });
    }
    if (lane == 0) {
      rec[s.fro2] += n2;
      rec[s.max_norm] = fmaxf(rec[s.max_norm], sqrtf(n2));
      rec[s.count] += 1.0f;
    }
    __syncwarp();
  }
  if (lane == 0 && s.principal >= 0 && ap.count > 0) rec[s.principal + 2] = 0.0f;
}

// One block per run (grid-stride): record r of a run, word w = empty[w].
// runs: [n]; empty: [words], the record core's ResetRecord writes.
__global__ void ResetKernel(const RecordRun* runs, int n, const float* empty, int words) {
  for (int r = blockIdx.x; r < n; r += gridDim.x) {
    const RecordRun run = runs[r];
    const int64_t total = run.records * words;
    for (int64_t j = threadIdx.x; j < total; j += blockDim.x) run.first[j] = empty[j % words];
  }
}

// InvalidArgument unless `record` is non-null and 16-byte aligned (the pool contract: the
// kernels' misaligned access would be a sticky error that ends the CUDA context).
absl::Status CheckRecordAddress(const char* what, size_t i, const float* record) {
  if (record == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, "[", i, "] is null"));
  if (reinterpret_cast<uintptr_t>(record) % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, "[", i, "]: record address 0x", absl::Hex(reinterpret_cast<uintptr_t>(record)),
        " is not 16-byte aligned (records are 16-byte aligned in the pool)"));
  }
  return absl::OkStatus();
}

// InvalidArgument when two of `spans` (start address, words, index) overlap; sorts them.
absl::Status CheckDisjoint(const char* what,
                           std::vector<std::tuple<uintptr_t, int64_t, size_t>>& spans) {
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    const auto& [prev, prev_words, prev_index] = spans[i - 1];
    const auto& [here, words, index] = spans[i];
    if (here < prev + static_cast<uintptr_t>(prev_words) * sizeof(float)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, "[", std::max(index, prev_index), "] overlaps the record(s) ", what,
                       "[", std::min(index, prev_index), "] of this call writes (", prev_words,
                       " words from its address; two writers of one record race)"));
    }
  }
  return absl::OkStatus();
}

// Each staging slot's bytes at Create (DeviceSummaryWriter::kStagingSlots of them).
constexpr size_t kStagingSlotBytes = size_t{256} << 10;  // 6553 appends

// Pinned host memory that AppendAsync and Reset copy their arguments up from. A copy from
// pageable memory may wait for its stream (CUDA stages it, and may synchronise with the
// stream to do so), and the engine's stream may be held by a wait for epsd's lists: the
// "never waits" calls would then hold the engine's thread. Each slot's event marks its copy
// done; a slot is refilled only after that, so an in-flight copy never reads new bytes.
// Slots are never freed before the writer (cudaFreeHost waits for the device): a call that
// finds none free and large enough adds one (cudaMallocHost, which CUDA may order after the
// device's work: hence enough slots made at Create for the usual calls).
class PinnedStaging {
 public:
  PinnedStaging() = default;
  ~PinnedStaging();
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;

  // Adds `slots` slots of `bytes` each (the writer's Create: the usual calls never allocate).
  absl::Status Reserve(int slots, size_t bytes);
  // Queues on `stream` the copy of host[0, bytes) to `device` through a slot; returns once
  // the bytes are in the slot, without waiting for the stream.
  absl::Status CopyToDevice(void* device, const void* host, size_t bytes, cudaStream_t stream);

 private:
  struct Slot {
    Slot() = default;
    ~Slot() {  // its copy is done (PinnedStaging's destructor waits for it)
      if (copied != nullptr) cudaEventDestroy(copied);
      if (host != nullptr) cudaFreeHost(host);
    }
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;
    void* host = nullptr;  // pinned, `capacity` bytes
    size_t capacity = 0;
    cudaEvent_t copied = nullptr;
    bool recorded = false;  // `copied` marks a queued copy out of this slot
    bool filling = false;   // a call holds it between choosing it and recording `copied`
  };
  static absl::StatusOr<std::unique_ptr<Slot>> NewSlot(size_t bytes);
  // A slot of at least `bytes` whose last copy is done, marked filling; null if none.
  absl::StatusOr<Slot*> TakeFree(size_t bytes);

  std::mutex mu_;
  std::vector<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
};

PinnedStaging::~PinnedStaging() {
  std::lock_guard lock(mu_);
  for (const std::unique_ptr<Slot>& s : slots_) {
    // Its copy may still read the slot. A failure reports nothing here, and is taken off
    // the thread's last error, not left for the engine's next check; the caller's stays.
    if (s->recorded && cudaEventSynchronize(s->copied) != cudaSuccess) ClearFailedCall();
  }
  slots_.clear();
}

absl::StatusOr<std::unique_ptr<PinnedStaging::Slot>> PinnedStaging::NewSlot(size_t bytes) {
  auto slot = std::make_unique<Slot>();
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&slot->host, bytes));
  slot->capacity = bytes;
  CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot->copied, cudaEventDisableTiming));
  return slot;
}

absl::Status PinnedStaging::Reserve(int slots, size_t bytes) {
  for (int i = 0; i < slots; ++i) {
    ASSIGN_OR_RETURN(std::unique_ptr<Slot> slot, NewSlot(bytes));
    std::lock_guard lock(mu_);
    slots_.push_back(std::move(slot));
  }
  return absl::OkStatus();
}

absl::StatusOr<PinnedStaging::Slot*> PinnedStaging::TakeFree(size_t bytes) {
  std::lock_guard lock(mu_);
  for (const std::unique_ptr<Slot>& s : slots_) {
    if (s->filling || s->capacity < bytes) continue;
    if (s->recorded) {
      const cudaError_t done = cudaEventQuery(s->copied);
      // "Not yet" sets no last error (2 x H200, CUDA 13): clearing here would take the
      // caller's own pending error.
      if (done == cudaErrorNotReady) continue;
      if (done != cudaSuccess) return CudaFailure("cudaEventQuery", done);
    }
    s->filling = true;
    return s.get();
  }
  return nullptr;
}

absl::Status PinnedStaging::CopyToDevice(void* device, const void* host, size_t bytes,
                                         cudaStream_t stream) {
  ASSIGN_OR_RETURN(Slot * slot, TakeFree(bytes));
  if (slot == nullptr) {
    // Every slot busy or too small: a new one, sized in powers of two so growth is rare.
    size_t capacity = size_t{1} << 16;
    while (capacity < bytes) capacity *= 2;
    ASSIGN_OR_RETURN(std::unique_ptr<Slot> added, NewSlot(capacity));
    added->filling = true;
    slot = added.get();
    std::lock_guard lock(mu_);
    slots_.push_back(std::move(added));
  }
  std::memcpy(slot->host, host, bytes);
  const cudaError_t copied =
      cudaMemcpyAsync(device, slot->host, bytes, cudaMemcpyHostToDevice, stream);
  const cudaError_t recorded =
      copied == cudaSuccess ? cudaEventRecord(slot->copied, stream) : cudaSuccess;
  std::lock_guard lock(mu_);
  if (copied != cudaSuccess) {
    slot->filling = false;  // nothing queued reads it; its earlier event still holds
    return CudaFailure("cudaMemcpyAsync", copied);
  }
  if (recorded != cudaSuccess) {
    // A queued copy reads the slot and no event says when it is done: never reuse it.
    return CudaFailure("cudaEventRecord", recorded);
  }
  slot->recorded = true;
  slot->filling = false;
  return absl::OkStatus();
}

// Copies `bytes` from `host` into stream-ordered scratch on `stream` through `staging`
// and runs launch(scratch), then frees the scratch behind it: calls on different streams
// never share it, and nothing here waits for the stream.
// (Statuses built by returns, not assigned: nvcc warns on the ignored result of
// absl::Status's assignment, a nodiscard type.)
template <class Launch>
absl::Status WithStreamScratch(PinnedStaging& staging, const void* host, size_t bytes,
                               cudaStream_t stream, Launch launch) {
  void* scratch = nullptr;
  CUDA_RETURN_IF_ERROR(cudaMallocAsync(&scratch, bytes, stream));
  auto copy_and_launch = [&]() -> absl::Status {
    RETURN_IF_ERROR(staging.CopyToDevice(scratch, host, bytes, stream));
    return launch(scratch);
  };
  const absl::Status s = copy_and_launch();
  const cudaError_t freed = cudaFreeAsync(scratch, stream);
  if (freed != cudaSuccess) {
    ClearFailedCall();  // also when `s` is the error returned
    if (s.ok()) return CudaStatus("cudaFreeAsync", freed);
  }
  return s;
}

}  // namespace

struct DeviceSummaryWriter::Impl {
  ModelLayout model;
  SummaryLayout layout;
  int device = 0;
  DeviceBuffer<float> phi;
  DeviceBuffer<float> empty;  // [record_words]: ResetRecord's bytes
  // AppendAsync's and Reset's arguments on their way up. Declared after the device buffers:
  // destroyed first, once its copies are done.
  PinnedStaging staging;
  // Append's scratch: one synchronous call at a time.
  std::mutex mu;
  DeviceBuffer<KeyAppend> appends ABSL_GUARDED_BY(mu);
  int64_t capacity ABSL_GUARDED_BY(mu) = 0;
  DeviceBuffer<int> bad ABSL_GUARDED_BY(mu);
};

DeviceSummaryWriter::DeviceSummaryWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceSummaryWriter::~DeviceSummaryWriter() = default;

absl::StatusOr<std::unique_ptr<DeviceSummaryWriter>> DeviceSummaryWriter::Create(
    const ModelLayout& model, int device) {
  if (absl::Status s = model.Validate(); !s.ok()) return s;
  if (model.sketch_dim > 64)
    return absl::InvalidArgumentError("the device writer supports m <= 64");
  auto impl = std::make_unique<Impl>();
  impl->model = model;
  impl->layout = SummaryLayout::For(model);
  impl->device = device;
  RETURN_IF_ERROR(SetDevice(device));
  const int per_matrix = model.head_dim * model.sketch_dim;
  RETURN_IF_CUDA_ALLOC(impl->phi, int64_t{model.num_layers} * model.num_kv_heads * per_matrix);
  RETURN_IF_CUDA_ALLOC(impl->bad, 1);
  std::vector<float> empty(impl->layout.record_words);
  RETURN_IF_ERROR(ResetRecord(impl->layout, empty));
  RETURN_IF_CUDA_ALLOC(impl->empty, impl->layout.record_words);
  CUDA_RETURN_IF_ERROR(cudaMemcpy(impl->empty.get(), empty.data(), empty.size() * sizeof(float),
                                  cudaMemcpyHostToDevice));
  CUDA_RETURN_IF_ERROR(LaunchKernel(GeneratePhiKernel, 128, 256, 0, nullptr, model.phi_seed,
                                    model.num_layers, model.num_kv_heads, per_matrix,
                                    PhiScale(model.sketch_dim), impl->phi.get()));
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  // Staging for a few calls in flight, each of a decode step's appends of a large batch
  // (40 bytes an append); a larger or further call adds a slot.
  RETURN_IF_ERROR(impl->staging.Reserve(kStagingSlots, kStagingSlotBytes));
  // Both kernels loaded now, as gpu/stream_ops.h PreloadStreamOps loads its own: an engine
  // queues them behind its waits on counters, and a kernel's first launch, were it loaded
  // lazily then, would wait for the context to go idle, which such a wait holds up.
  cudaFuncAttributes attributes;
  CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&AppendKernel)));
  CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&ResetKernel)));
  return std::unique_ptr<DeviceSummaryWriter>(new DeviceSummaryWriter(std::move(impl)));
}

absl::Status DeviceSummaryWriter::Check(const std::vector<KeyAppend>& appends,
                                        DType key_dtype) const {
  const Impl& w = *impl_;
  if (key_dtype != DType::kFloat32 && key_dtype != DType::kFloat16 &&
      key_dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("key dtype ", DTypeName(key_dtype), " is not a float type"));
  }
  if (appends.size() > static_cast<size_t>(kMaxAppends)) {
    return absl::InvalidArgumentError(absl::StrCat(appends.size(), " appends in one call"));
  }
  for (size_t i = 0; i < appends.size(); ++i) {
    const KeyAppend& a = appends[i];
    if (a.layer < 0 || a.layer >= w.model.num_layers || a.kv_head < 0 ||
        a.kv_head >= w.model.num_kv_heads) {
      return absl::InvalidArgumentError(absl::StrCat("appends[", i, "]: (layer, kv_head)=(",
                                                     a.layer, ", ", a.kv_head, ") out of range"));
    }
    if ((a.count > 0 && a.keys == nullptr) || a.count < 0 ||
        (a.stride != 0 && a.stride < w.model.head_dim)) {
      return absl::InvalidArgumentError(
          absl::StrCat("appends[", i, "] is malformed: count=", a.count, ", stride=", a.stride));
    }
    RETURN_IF_ERROR(CheckRecordAddress("appends", i, a.record));
    if (reinterpret_cast<uintptr_t>(a.keys) % DTypeSize(key_dtype) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("appends[", i, "]: keys address 0x",
                       absl::Hex(reinterpret_cast<uintptr_t>(a.keys)), " is not aligned to its ",
                       DTypeSize(key_dtype), "-byte ", DTypeName(key_dtype), " elements"));
    }
  }
  // Disjoint records: sorted addresses, then neighbours (a set costs more per step). Equal
  // or overlapping records (record + 1) would have two warps race on the same words.
  std::vector<std::tuple<uintptr_t, int64_t, size_t>> spans(appends.size());
  for (size_t i = 0; i < appends.size(); ++i) {
    spans[i] = {reinterpret_cast<uintptr_t>(appends[i].record), w.layout.record_words, i};
  }
  RETURN_IF_ERROR(CheckDisjoint("appends", spans));
  return absl::OkStatus();
}

absl::Status DeviceSummaryWriter::Launch(const KeyAppend* device_appends, int n, DType key_dtype,
                                         cudaStream_t stream, int* bad,
                                         unsigned long long* skipped) {
  const Impl& w = *impl_;
  const SummaryLayout& l = w.layout;
  const WriterShape s{
      w.model.head_dim, w.model.sketch_dim, l.gram_words, w.model.num_layers, w.model.num_kv_heads,
      l.fro2,           l.max_norm,         l.count,      l.key_sum,          l.quest_min,
      l.quest_max,      l.principal,        l.quest8,     key_dtype};
  CUDA_RETURN_IF_ERROR(LaunchKernel(AppendKernel, (n + 7) / 8, 256, 0, stream, s, device_appends, n,
                                    w.phi.get(), bad, skipped));
  return absl::OkStatus();
}

absl::Status DeviceSummaryWriter::Append(const std::vector<KeyAppend>& appends, DType key_dtype,
                                         cudaStream_t stream) {
  Impl& w = *impl_;
  if (appends.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(Check(appends, key_dtype));
  std::lock_guard lock(w.mu);
  RETURN_IF_ERROR(SetDevice(w.device));
  if (static_cast<int64_t>(appends.size()) > w.capacity) {
    w.capacity = 0;  // a failed allocation leaves none (the old one is freed first)
    RETURN_IF_CUDA_ALLOC(w.appends, static_cast<int64_t>(appends.size()));
    w.capacity = static_cast<int64_t>(appends.size());
  }
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(w.appends.get(), appends.data(),
                                       appends.size() * sizeof(KeyAppend), cudaMemcpyHostToDevice,
                                       stream));
  const int none = INT32_MAX;
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(w.bad.get(), &none, sizeof(int), cudaMemcpyHostToDevice, stream));
  RETURN_IF_ERROR(Launch(w.appends.get(), static_cast<int>(appends.size()), key_dtype, stream,
                         w.bad.get(), nullptr));
  int bad = none;
  CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&bad, w.bad.get(), sizeof(int), cudaMemcpyDeviceToHost, stream));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  if (bad != none) {
    return absl::InvalidArgumentError(DescribeRefused(appends[bad], key_dtype, bad));
  }
  return absl::OkStatus();
}

// Replays core's CheckKeys rules on the host over the refused append's keys (read back: an
// error path only), so that the message names the key and element as core's does.
std::string DeviceSummaryWriter::DescribeRefused(const KeyAppend& a, DType key_dtype,
                                                 int index) const {
  const Impl& w = *impl_;
  const int d = w.model.head_dim;
  const bool quest = w.layout.quest_min >= 0;
  const std::string where =
      absl::StrCat("appends[", index, "] (layer ", a.layer, ", kv_head ", a.kv_head, ")");
  const std::string generic = absl::StrCat(
      where, " holds a non-finite key",
      quest ? ", one beyond the binary16 range of the quest "
              "summary (|k| <= 65504)"
            : "",
      " or keys that would take the record's sums out of the float range (d * sum of squared "
      "norms >= FLT_MAX); it was skipped");
  const int64_t stride = a.stride == 0 ? d : a.stride;
  const int64_t elements = (a.count - 1) * stride + d;
  std::vector<unsigned char> keys(elements * DTypeSize(key_dtype));
  float fro2 = 0.0f;
  if (a.count <= 0) return generic;
  if (cudaMemcpy(keys.data(), a.keys, keys.size(), cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(&fro2, a.record + w.layout.fro2, sizeof fro2, cudaMemcpyDeviceToHost) !=
          cudaSuccess) {
    ClearFailedCall();  // the append's refusal is the error this call reports
    return generic;
  }
  double sum = std::max(0.0f, fro2);
  for (int64_t t = 0; t < a.count; ++t) {
    for (int i = 0; i < d; ++i) {
      const float k = LoadAsFloat(keys.data(), key_dtype, t * stride + i);
      if (!std::isfinite(k) || (quest && std::abs(k) > kHalfMax)) {
        return absl::StrCat(where, ": key ", t, " element ", i, " is ", k,
                            std::isfinite(k) ? ": beyond the binary16 range of the quest "
                                               "summary, |k| <= 65504"
                                             : "",
                            "; the append was skipped");
      }
      sum += double{k} * k;
    }
    if (sum * d >= std::numeric_limits<float>::max()) {
      return absl::StrCat(where, ": key ", t, " brings the record's sum of squared key norms to ",
                          sum, ": its sums would leave the float range (d * sum must stay below ",
                          std::numeric_limits<float>::max(), "); the append was skipped");
    }
  }
  return generic;  // the device's sum rounded across the limit where this one did not
}

absl::Status DeviceSummaryWriter::Reset(const std::vector<RecordRun>& runs, cudaStream_t stream) {
  const Impl& w = *impl_;
  if (runs.empty()) return absl::OkStatus();
  if (runs.size() > static_cast<size_t>(kMaxRuns)) {
    return absl::InvalidArgumentError(absl::StrCat(runs.size(), " runs in one call"));
  }
  std::vector<std::tuple<uintptr_t, int64_t, size_t>> spans(runs.size());
  const int64_t words = w.layout.record_words;
  for (size_t i = 0; i < runs.size(); ++i) {
    RETURN_IF_ERROR(CheckRecordAddress("runs", i, runs[i].first));
    if (runs[i].records < 0 || runs[i].records > INT64_MAX / 4 / words) {
      return absl::InvalidArgumentError(
          absl::StrCat("runs[", i, "].records=", runs[i].records, " is out of range"));
    }
    spans[i] = {reinterpret_cast<uintptr_t>(runs[i].first), runs[i].records * words, i};
  }
  RETURN_IF_ERROR(CheckDisjoint("runs", spans));
  RETURN_IF_ERROR(SetDevice(w.device));
  return WithStreamScratch(
      impl_->staging, runs.data(), runs.size() * sizeof(RecordRun), stream,
      [&](void* scratch) -> absl::Status {
        const int n = static_cast<int>(runs.size());
        CUDA_RETURN_IF_ERROR(LaunchKernel(ResetKernel, std::min(n, 4096), 256, 0, stream,
                                          static_cast<const RecordRun*>(scratch), n, w.empty.get(),
                                          static_cast<int>(words)));
        return absl::OkStatus();
      });
}

absl::Status DeviceSummaryWriter::AppendAsync(const std::vector<KeyAppend>& appends,
                                              DType key_dtype, cudaStream_t stream,
                                              unsigned long long* skipped) {
  if (appends.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(Check(appends, key_dtype));
  RETURN_IF_ERROR(SetDevice(impl_->device));
  return WithStreamScratch(impl_->staging, appends.data(), appends.size() * sizeof(KeyAppend),
                           stream, [&](void* scratch) {
                             return Launch(static_cast<const KeyAppend*>(scratch),
                                           static_cast<int>(appends.size()), key_dtype, stream,
                                           nullptr, skipped);
                           });
}

}  // namespace eps::gpu
