// The C ABI of engine_capi.h over gpu/stream_ops.h, gpu/summary.h,
// engine_summary_queue.h and engine_outputs.h: conversions and error codes only.
#include "client/cpp/engine_capi.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/cpp/device_scope.h"
#include "client/cpp/engine_outputs.h"
#include "client/cpp/engine_summary_queue.h"
#include "client/cpp/selection_watchdog.h"
#include "client/cpp/watchdog_handle.h"
#include "core/layout.h"
#include "core/status.h"
#include "gpu/cuda_check.h"
#include "gpu/stream_ops.h"
#include "gpu/summary.h"

namespace {

thread_local std::string last_error;

int Report(const absl::Status& status) {
  if (status.ok()) return 0;
  last_error = status.ToString();
  return static_cast<int>(status.code());
}

// InvalidArgument naming the call and what it lacks: every entry point checks its handle,
// out-pointers and arrays before anything dereferences them (a null flags pointer once
// made a device atomic at address 8, a fault that ends the CUDA context).
int Refuse(const char* call, const std::string& what) {
  return Report(absl::InvalidArgumentError(absl::StrCat(call, ": ", what)));
}

// The appends array of (appends, n): n >= 0, and the array non-null when n > 0.
int CheckAppends(const char* call, const EpsKeyAppend* appends, int64_t n) {
  if (n < 0) return Refuse(call, absl::StrCat("n=", n, " is negative"));
  if (n > 0 && appends == nullptr) return Refuse(call, absl::StrCat("appends is null, n=", n));
  return 0;
}

// 0, or INVALID_ARGUMENT when the device address `address` of `name` is not a multiple of
// `alignment` (that of the widest word the call's kernels or stream ops access there): a
// misaligned device atomic or store faults, and a fault ends the CUDA context.
int CheckAligned(const char* call, const char* name, uint64_t address, uint64_t alignment) {
  if (address % alignment == 0) return 0;
  return Refuse(
      call, absl::StrCat(name, "=0x", absl::Hex(address), " is not ", alignment, "-byte aligned"));
}

// CheckAligned over several device arrays of one element type, in order: the first
// misaligned one's refusal. The engine outputs' arrays are all int32 (4 bytes).
int CheckAllAligned(const char* call,
                    std::initializer_list<std::pair<const char*, uint64_t>> addresses,
                    uint64_t alignment) {
  for (const auto& [name, address] : addresses) {
    if (int rc = CheckAligned(call, name, address, alignment); rc != 0) return rc;
  }
  return 0;
}

cudaStream_t Stream(uint64_t handle) { return reinterpret_cast<cudaStream_t>(handle); }
template <typename T>
T* Ptr(uint64_t address) {
  return reinterpret_cast<T*>(address);
}

absl::StatusOr<eps::DType> KeyDType(int32_t code) {
  switch (code) {
    case EPS_ENGINE_FLOAT32:
      return eps::DType::kFloat32;
    case EPS_ENGINE_FLOAT16:
      return eps::DType::kFloat16;
    case EPS_ENGINE_BFLOAT16:
      return eps::DType::kBFloat16;
    default:
      return absl::InvalidArgumentError(absl::StrCat("key_dtype=", code, " is not 1, 2 or 3"));
  }
}

// The caller checked (in, n) with CheckAppends.
std::vector<eps::gpu::KeyAppend> Appends(const EpsKeyAppend* in, int64_t n) {
  std::vector<eps::gpu::KeyAppend> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    out[i] = {Ptr<float>(in[i].record),
              Ptr<const void>(in[i].keys),
              in[i].count,
              in[i].stride,
              in[i].layer,
              in[i].kv_head};
  }
  return out;
}

eps::client::VisitListsDevice VisitLists(uint64_t visit_blocks, uint64_t visit_count,
                                         int32_t layers, int64_t max_batch, int32_t lists,
                                         int64_t max_blocks) {
  return {Ptr<const int32_t>(visit_blocks),
          Ptr<const int32_t>(visit_count),
          layers,
          max_batch,
          lists,
          max_blocks};
}

eps::client::EngineTableDevice EngineTable(uint64_t engine_table, int64_t table_stride,
                                           uint64_t context_tokens, int64_t batch,
                                           int32_t block_size, int64_t cache_blocks) {
  return {Ptr<const int32_t>(engine_table),
          table_stride,
          Ptr<const int32_t>(context_tokens),
          batch,
          block_size,
          cache_blocks};
}

// `work` queued on the caller's `stream` (not waited for), or with stream 0 on a private
// stream, waited for.
// A failed call's status is marked device-lost as every other CUDA failure of the ABI is
// (gpu/cuda_check.h CudaStatus), and its error is not left pending on the caller's thread.
absl::Status OnStream(uint64_t stream, const std::function<absl::Status(cudaStream_t)>& work) {
  if (stream != 0) return work(Stream(stream));
  cudaStream_t own = nullptr;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  absl::Status s = work(own);
  if (s.ok()) {
    if (const cudaError_t err = cudaStreamSynchronize(own); err != cudaSuccess) {
      s = eps::gpu::CudaFailure("cudaStreamSynchronize of the private stream", err);
    }
  }
  if (cudaStreamDestroy(own) != cudaSuccess) eps::gpu::ClearFailedCall();
  return s;
}

}  // namespace

// The C ABI's watchdog: client/cpp/selection_watchdog.h's, whose device is a stream
// and a pinned word of its own over the engine's raw pointers (the step's n counts and
// its flags). A failed create leaves the cleanup to the destructor.
struct EpsEngineWatchdog {
  int device = 0;
  int32_t* counts = nullptr;
  int64_t n = 0;
  uint64_t* flags = nullptr;
  // Set by the engine's thread (eps_engine_watchdog_clear_feedback), read by the watchdog's
  // in ReleaseDense: a release in progress finishes before the feedback changes.
  absl::Mutex feedback_mu;
  // NaN-filled before each release (eps_engine_watchdog_clear_feedback).
  float* feedback ABSL_GUARDED_BY(feedback_mu) = nullptr;
  int64_t feedback_n ABSL_GUARDED_BY(feedback_mu) = 0;
  cudaStream_t stream = nullptr;
  uint64_t* host_done = nullptr;  // pinned
  // Every eps_engine_watchdog_* call goes through it: once the destroy has begun, calls
  // from other threads are refused while it finishes the armed step's watch.
  std::unique_ptr<eps::client::WatchdogHandle> watchdog;

  ~EpsEngineWatchdog() {
    // First: the watchdog reads and releases through the stream.
    if (watchdog != nullptr) watchdog->Destroy();
    if (stream != nullptr || host_done != nullptr) cudaSetDevice(device);
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (host_done != nullptr) cudaFreeHost(host_done);
  }

  absl::StatusOr<uint64_t> ReadDone() {
    eps::client::DeviceScope scope;
    RETURN_IF_ERROR(scope.Enter(device));
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host_done, flags + 1, sizeof(uint64_t), cudaMemcpyDeviceToHost, stream));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return *host_done;
  }

  absl::Status ReleaseDense(uint64_t step) {
    eps::client::DeviceScope scope;
    RETURN_IF_ERROR(scope.Enter(device));
    absl::MutexLock lock(&feedback_mu);
    RETURN_IF_ERROR(eps::gpu::StreamClearFeedback(stream, feedback, feedback_n));
    RETURN_IF_ERROR(eps::gpu::StreamReleaseDense(stream, counts, n, flags + 1, step));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return absl::OkStatus();
  }
};

// Shared with the queues made from it (SummaryQueue keeps its writer alive), so that
// destroying the writer before a queue is safe.
struct EpsSummaryWriter {
  std::shared_ptr<eps::gpu::DeviceSummaryWriter> writer;
  int32_t record_words = 0;
};

struct EpsSummaryQueue {
  std::unique_ptr<eps::client::SummaryQueue> queue;
};

extern "C" {

int eps_engine_abi_version(void) { return EPS_ENGINE_ABI_VERSION; }

const char* eps_engine_last_error(void) { return last_error.c_str(); }

int eps_engine_peek_cuda_error(void) { return static_cast<int>(cudaPeekAtLastError()); }

int eps_engine_device_count(int32_t* count) {
  if (count == nullptr) return Refuse("eps_engine_device_count", "count is null");
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    eps::gpu::ClearFailedCall();  // no device is not an error here
    n = 0;
  }
  *count = n;
  return 0;
}

int eps_engine_preload(int32_t device) {
  eps::client::DeviceScope scope;  // the caller's current device is restored on return
  if (int rc = Report(scope.Enter(device)); rc != 0) return rc;
  if (int rc = Report(eps::gpu::PreloadStreamOps()); rc != 0) return rc;
  return Report(eps::client::PreloadEngineOutputs());
}

int eps_engine_signal_inputs_ready(uint64_t stream, uint64_t flags, uint64_t step) {
  if (flags == 0) return Refuse("eps_engine_signal_inputs_ready", "flags is null");
  if (int rc = CheckAligned("eps_engine_signal_inputs_ready", "flags", flags, 8); rc != 0) {
    return rc;
  }
  return Report(eps::gpu::StreamWriteCounter(Stream(stream), Ptr<uint64_t>(flags), step));
}

int eps_engine_wait_selection(uint64_t stream, uint64_t flags, uint64_t step) {
  if (flags == 0) return Refuse("eps_engine_wait_selection", "flags is null");
  if (int rc = CheckAligned("eps_engine_wait_selection", "flags", flags, 8); rc != 0) return rc;
  return Report(eps::gpu::StreamWaitCounter(Stream(stream), Ptr<uint64_t>(flags) + 1, step));
}

int eps_engine_wait_counter(uint64_t stream, uint64_t counter, uint64_t value) {
  if (counter == 0) return Refuse("eps_engine_wait_counter", "counter is null");
  if (int rc = CheckAligned("eps_engine_wait_counter", "counter", counter, 8); rc != 0) return rc;
  return Report(eps::gpu::StreamWaitCounter(Stream(stream), Ptr<uint64_t>(counter), value));
}

int eps_engine_release_dense(int32_t device, uint64_t visit_count, int64_t n, uint64_t flags,
                             uint64_t step, uint64_t stream) {
  if (flags == 0) return Refuse("eps_engine_release_dense", "flags is null");
  if (n < 0) return Refuse("eps_engine_release_dense", absl::StrCat("n=", n, " is negative"));
  if (n > 0 && visit_count == 0) {
    return Refuse("eps_engine_release_dense", absl::StrCat("visit_count is null, n=", n));
  }
  if (int rc = CheckAligned("eps_engine_release_dense", "flags", flags, 8); rc != 0) return rc;
  if (int rc = CheckAligned("eps_engine_release_dense", "visit_count", visit_count, 4); rc != 0) {
    return rc;
  }
  eps::client::DeviceScope scope;  // the caller's current device is restored on return
  if (int rc = Report(scope.Enter(device)); rc != 0) return rc;
  return Report(OnStream(stream, [&](cudaStream_t s) {
    return eps::gpu::StreamReleaseDense(s, Ptr<int32_t>(visit_count), n, Ptr<uint64_t>(flags) + 1,
                                        step);
  }));
}

int eps_engine_clear_feedback(int32_t device, uint64_t feedback, int64_t n, uint64_t stream) {
  if (n < 0) return Refuse("eps_engine_clear_feedback", absl::StrCat("n=", n, " is negative"));
  if (n > 0 && feedback == 0) {
    return Refuse("eps_engine_clear_feedback", absl::StrCat("feedback is null, n=", n));
  }
  if (int rc = CheckAligned("eps_engine_clear_feedback", "feedback", feedback, alignof(float));
      rc != 0) {
    return rc;
  }
  if (n == 0) return 0;
  eps::client::DeviceScope scope;  // the caller's current device is restored on return
  if (int rc = Report(scope.Enter(device)); rc != 0) return rc;
  return Report(OnStream(stream, [&](cudaStream_t s) {
    return eps::gpu::StreamClearFeedback(s, Ptr<float>(feedback), n);
  }));
}

int eps_engine_watchdog_clear_feedback(EpsEngineWatchdog* w, uint64_t feedback, int64_t n) {
  // The buffer before the handle (either refusal is INVALID_ARGUMENT): its checks need no
  // watchdog, so they are tested without a device.
  if (n < 0 || (n > 0 && feedback == 0)) {
    return Refuse("eps_engine_watchdog_clear_feedback",
                  absl::StrCat("n=", n, " must be >= 0 and feedback non-null when n > 0"));
  }
  if (int rc =
          CheckAligned("eps_engine_watchdog_clear_feedback", "feedback", feedback, alignof(float));
      rc != 0) {
    return rc;
  }
  if (w == nullptr) {
    return Refuse("eps_engine_watchdog_clear_feedback", "the watchdog is null (destroyed?)");
  }
  return Report(
      w->watchdog->Run("eps_engine_watchdog_clear_feedback", [&](eps::client::SelectionWatchdog&) {
        absl::MutexLock lock(&w->feedback_mu);
        w->feedback = Ptr<float>(feedback);
        w->feedback_n = n;
        return absl::OkStatus();
      }));
}

int eps_engine_watchdog_create(int32_t device, uint64_t visit_count, int64_t n, uint64_t flags,
                               int64_t timeout_us, EpsEngineWatchdog** out) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  if (out == nullptr) return Refuse("eps_engine_watchdog_create", "out is null");
  using eps::client::SelectionWatchdog;
  if (timeout_us < 1 || timeout_us > SelectionWatchdog::kMaxTimeout.count() || n < 1 ||
      visit_count == 0 || flags == 0) {
    return Report(absl::InvalidArgumentError(absl::StrCat(
        "watchdog: timeout_us=", timeout_us, " must be in [1, ",
        SelectionWatchdog::kMaxTimeout.count(), "], n=", n, " >= 1 and the pointers non-null")));
  }
  if (int rc = CheckAligned("eps_engine_watchdog_create", "flags", flags, 8); rc != 0) return rc;
  if (int rc = CheckAligned("eps_engine_watchdog_create", "visit_count", visit_count, 4); rc != 0) {
    return rc;
  }
  auto w = std::make_unique<EpsEngineWatchdog>();
  w->device = device;
  w->counts = Ptr<int32_t>(visit_count);
  w->n = n;
  w->flags = Ptr<uint64_t>(flags);
  auto fail = [](const char* call, cudaError_t err) {
    return Report(eps::gpu::CudaFailure(absl::StrCat("watchdog: ", call), err));
  };
  if (int rc = Report(eps::gpu::SetDevice(device)); rc != 0) return rc;
  if (const cudaError_t err = cudaStreamCreateWithFlags(&w->stream, cudaStreamNonBlocking);
      err != cudaSuccess) {
    w->stream = nullptr;
    return fail("cudaStreamCreateWithFlags", err);
  }
  // From here on a failure leaves the cleanup to ~EpsEngineWatchdog (with `w`).
  if (const cudaError_t err = cudaMallocHost(&w->host_done, sizeof(uint64_t)); err != cudaSuccess) {
    w->host_done = nullptr;
    return fail("cudaMallocHost", err);
  }
  if (int rc = Report(eps::gpu::PreloadStreamOps()); rc != 0) return rc;
  EpsEngineWatchdog* raw = w.get();
  absl::StatusOr<std::unique_ptr<SelectionWatchdog>> made = SelectionWatchdog::Create(
      {.read_done = [raw] { return raw->ReadDone(); },
       .release_dense = [raw](uint64_t step) { return raw->ReleaseDense(step); }},
      std::chrono::microseconds(timeout_us));
  if (!made.ok()) return Report(made.status());
  w->watchdog = std::make_unique<eps::client::WatchdogHandle>(*std::move(made));
  *out = w.release();
  return 0;
}

int eps_engine_watchdog_arm(EpsEngineWatchdog* w, uint64_t step) {
  // The step before the handle (either refusal is INVALID_ARGUMENT), so that its check is
  // tested without a device. 0 is the watchdog's "nothing armed": taken as a step, it
  // once dropped the armed step's watch and returned 0.
  if (step == 0) return Refuse("eps_engine_watchdog_arm", "step=0: steps start at 1");
  if (w == nullptr) return Refuse("eps_engine_watchdog_arm", "the watchdog is null (destroyed?)");
  return Report(
      w->watchdog->Run("eps_engine_watchdog_arm",
                       [step](eps::client::SelectionWatchdog& dog) { return dog.Arm(step); }));
}

uint64_t eps_engine_watchdog_releases(EpsEngineWatchdog* w) {
  if (w == nullptr) {
    Refuse("eps_engine_watchdog_releases", "the watchdog is null (destroyed?)");
    return 0;
  }
  uint64_t releases = 0;
  Report(w->watchdog->Run("eps_engine_watchdog_releases",
                          [&releases](eps::client::SelectionWatchdog& dog) {
                            releases = dog.releases();
                            return absl::OkStatus();
                          }));
  return releases;
}

void eps_engine_watchdog_destroy(EpsEngineWatchdog* w) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  delete w;
}

int eps_engine_summary_writer_create(const EpsEngineModel* m, int32_t device,
                                     EpsSummaryWriter** out) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  if (m == nullptr) return Refuse("eps_engine_summary_writer_create", "model is null");
  if (out == nullptr) return Refuse("eps_engine_summary_writer_create", "out is null");
  eps::ModelLayout model;
  model.num_layers = m->num_layers;
  model.num_q_heads = m->num_q_heads;
  model.num_kv_heads = m->num_kv_heads;
  model.head_dim = m->head_dim;
  model.block_size = m->block_size;
  model.group_blocks = m->group_blocks;
  model.sketch_dim = m->sketch_dim;
  model.phi_seed = m->phi_seed;
  model.features.key_sum = m->key_sum != 0;
  model.features.principal = m->principal != 0;
  model.features.quest = m->quest != 0;
  model.features.quest8 = m->quest8 != 0;
  if (int rc = Report(model.Validate()); rc != 0) return rc;
  auto writer = eps::gpu::DeviceSummaryWriter::Create(model, device);
  if (!writer.ok()) return Report(writer.status());
  // One append into a scratch record now: the kernel is loaded before any engine stream
  // waits on the queue's counter (lazy loading would otherwise wait for an idle context).
  const int words = eps::SummaryLayout::For(model).record_words;
  eps::gpu::DeviceBuffer<float> scratch;
  if (absl::Status s = scratch.Allocate(words + model.head_dim); !s.ok()) return Report(s);
  if (const cudaError_t err =
          cudaMemset(scratch.get(), 0, sizeof(float) * (words + model.head_dim));
      err != cudaSuccess) {
    return Report(eps::gpu::CudaFailure("cudaMemset of the scratch record", err));
  }
  const eps::gpu::KeyAppend warm{scratch.get(), scratch.get() + words, 1, 0, 0, 0};
  if (int rc = Report((*writer)->Append({warm}, eps::DType::kFloat32)); rc != 0) return rc;
  *out = new EpsSummaryWriter{std::shared_ptr<eps::gpu::DeviceSummaryWriter>(std::move(*writer)),
                              words};
  return 0;
}

int eps_engine_summary_append(EpsSummaryWriter* w, const EpsKeyAppend* appends, int64_t n,
                              int32_t key_dtype, uint64_t stream) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  if (w == nullptr) return Refuse("eps_engine_summary_append", "the writer is null (destroyed?)");
  if (int rc = CheckAppends("eps_engine_summary_append", appends, n); rc != 0) return rc;
  absl::StatusOr<eps::DType> dtype = KeyDType(key_dtype);
  if (!dtype.ok()) return Report(dtype.status());
  return Report(w->writer->Append(Appends(appends, n), *dtype, Stream(stream)));
}

int eps_engine_summary_reset(EpsSummaryWriter* w, const EpsRecordRun* runs, int64_t n,
                             uint64_t stream) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  if (w == nullptr) return Refuse("eps_engine_summary_reset", "the writer is null (destroyed?)");
  if (n < 0) return Refuse("eps_engine_summary_reset", absl::StrCat("n=", n, " is negative"));
  if (n > 0 && runs == nullptr) {
    return Refuse("eps_engine_summary_reset", absl::StrCat("runs is null, n=", n));
  }
  std::vector<eps::gpu::RecordRun> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = {Ptr<float>(runs[i].first), runs[i].records};
  return Report(w->writer->Reset(out, Stream(stream)));
}

int eps_engine_summary_writer_record_words(const EpsSummaryWriter* w, int32_t* out) {
  if (w == nullptr) {
    return Refuse("eps_engine_summary_writer_record_words", "the writer is null (destroyed?)");
  }
  if (out == nullptr) return Refuse("eps_engine_summary_writer_record_words", "out is null");
  *out = w->record_words;
  return 0;
}

void eps_engine_summary_writer_destroy(EpsSummaryWriter* w) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  delete w;
}

int eps_engine_summary_queue_create(EpsSummaryWriter* writer, int32_t device,
                                    EpsSummaryQueue** out) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  if (writer == nullptr) {
    return Refuse("eps_engine_summary_queue_create", "the writer is null (destroyed?)");
  }
  if (out == nullptr) return Refuse("eps_engine_summary_queue_create", "out is null");
  auto q = eps::client::SummaryQueue::Create(writer->writer, device);
  if (!q.ok()) return Report(q.status());
  *out = new EpsSummaryQueue{std::move(*q)};
  return 0;
}

int eps_engine_summary_queue_submit(EpsSummaryQueue* q, const EpsKeyAppend* appends, int64_t n,
                                    int32_t key_dtype, uint64_t after_stream, uint64_t step) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  if (q == nullptr)
    return Refuse("eps_engine_summary_queue_submit", "the queue is null (destroyed?)");
  if (int rc = CheckAppends("eps_engine_summary_queue_submit", appends, n); rc != 0) return rc;
  absl::StatusOr<eps::DType> dtype = KeyDType(key_dtype);
  if (!dtype.ok()) return Report(dtype.status());
  return Report(q->queue->Submit(Appends(appends, n), *dtype, Stream(after_stream), step));
}

int eps_engine_summary_queue_wait(EpsSummaryQueue* q, uint64_t stream, uint64_t step) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  if (q == nullptr)
    return Refuse("eps_engine_summary_queue_wait", "the queue is null (destroyed?)");
  return Report(q->queue->WaitSummaries(Stream(stream), step));
}

int eps_engine_summary_queue_drain(EpsSummaryQueue* q) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  if (q == nullptr)
    return Refuse("eps_engine_summary_queue_drain", "the queue is null (destroyed?)");
  return Report(q->queue->Drain());
}

uint64_t eps_engine_summary_queue_errors(EpsSummaryQueue* q, char* buf, int64_t buf_len) {
  // The queue reads its device's skipped-append counter on its device.
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  std::string message;
  uint64_t errors = 0;
  if (q == nullptr) {
    Refuse("eps_engine_summary_queue_errors", "the queue is null (destroyed?)");
    message = last_error;
  } else {
    errors = q->queue->errors(&message);
  }
  if (buf != nullptr && buf_len > 0) {
    const size_t n = std::min<size_t>(message.size(), static_cast<size_t>(buf_len - 1));
    std::memcpy(buf, message.data(), n);
    buf[n] = '\0';
  }
  return errors;
}

void eps_engine_summary_queue_destroy(EpsSummaryQueue* q) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  delete q;
}

int eps_engine_flash_attention_views(uint64_t visit_blocks, uint64_t visit_count, int32_t layers,
                                     int64_t max_batch, int32_t lists, int64_t max_blocks,
                                     uint64_t engine_table, int64_t table_stride,
                                     uint64_t context_tokens, int64_t batch, int32_t block_size,
                                     int64_t cache_blocks, uint64_t block_table_out,
                                     uint64_t seqused_out, uint64_t refused_out, uint64_t stream) {
  if (int rc = CheckAllAligned("eps_engine_flash_attention_views",
                               {{"visit_blocks", visit_blocks},
                                {"visit_count", visit_count},
                                {"engine_table", engine_table},
                                {"context_tokens", context_tokens},
                                {"block_table_out", block_table_out},
                                {"seqused_out", seqused_out},
                                {"refused_out", refused_out}},
                               alignof(int32_t));
      rc != 0) {
    return rc;
  }
  const eps::client::VisitListsDevice v =
      VisitLists(visit_blocks, visit_count, layers, max_batch, lists, max_blocks);
  const eps::client::EngineTableDevice e =
      EngineTable(engine_table, table_stride, context_tokens, batch, block_size, cache_blocks);
  return Report(eps::client::BuildFlashAttentionViews(v, e, Ptr<int32_t>(block_table_out),
                                                      Ptr<int32_t>(seqused_out), Stream(stream),
                                                      Ptr<int32_t>(refused_out)));
}

int eps_engine_flashinfer_fixed(uint64_t visit_blocks, uint64_t visit_count, int32_t layers,
                                int64_t max_batch, int32_t lists, int64_t max_blocks,
                                uint64_t engine_table, int64_t table_stride,
                                uint64_t context_tokens, int64_t batch, int32_t block_size,
                                int64_t cache_blocks, uint64_t indptr, int64_t nnz,
                                uint64_t indices_out, uint64_t last_page_len_out,
                                uint64_t mismatched, uint64_t stream) {
  if (int rc = CheckAllAligned("eps_engine_flashinfer_fixed",
                               {{"visit_blocks", visit_blocks},
                                {"visit_count", visit_count},
                                {"engine_table", engine_table},
                                {"context_tokens", context_tokens},
                                {"indptr", indptr},
                                {"indices_out", indices_out},
                                {"last_page_len_out", last_page_len_out},
                                {"mismatched", mismatched}},
                               alignof(int32_t));
      rc != 0) {
    return rc;
  }
  const eps::client::VisitListsDevice v =
      VisitLists(visit_blocks, visit_count, layers, max_batch, lists, max_blocks);
  const eps::client::EngineTableDevice e =
      EngineTable(engine_table, table_stride, context_tokens, batch, block_size, cache_blocks);
  return Report(eps::client::BuildFlashInferFixedBudget(
      v, e, Ptr<const int32_t>(indptr), nnz, Ptr<int32_t>(indices_out),
      Ptr<int32_t>(last_page_len_out), Ptr<int32_t>(mismatched), Stream(stream)));
}

}  // extern "C"
