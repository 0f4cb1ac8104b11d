// The C ABI of engine_capi.h over gpu/stream_ops.h, the selection watchdog and
// engine_outputs.h: conversions and error codes only (the summary writer's and queue's entry
// points are engine_capi_summary.cc's). Every entry point but the *_destroy calls (destructors,
// noexcept) runs in capi::Guarded.
#include "client/cpp/engine_capi.h"

#include <cuda_runtime.h>

#include <chrono>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/cpp/capi_status.h"
#include "client/cpp/device_scope.h"
#include "client/cpp/engine_capi_args.h"
#include "client/cpp/engine_outputs.h"
#include "client/cpp/selection_watchdog.h"
#include "client/cpp/watchdog_handle.h"
#include "core/status.h"
#include "gpu/cuda_check.h"
#include "gpu/stream_ops.h"

namespace {

using eps::capi::Ptr;
using eps::capi::Refuse;
using eps::capi::Report;
using eps::capi::Stream;

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
    // Failures can only be ignored here; each is cleared (gpu::ClearFailedCall) so that the
    // engine thread's next unrelated error check does not report it.
    if (stream != nullptr || host_done != nullptr) eps::gpu::TrySetDevice(device);
    if (stream != nullptr && cudaStreamDestroy(stream) != cudaSuccess) eps::gpu::ClearFailedCall();
    if (host_done != nullptr && cudaFreeHost(host_done) != cudaSuccess) eps::gpu::ClearFailedCall();
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

extern "C" {

int eps_engine_abi_version(void) { return EPS_ENGINE_ABI_VERSION; }

const char* eps_engine_last_error(void) { return eps::capi::LastError(); }

int eps_engine_peek_cuda_error(void) { return static_cast<int>(cudaPeekAtLastError()); }

int eps_engine_device_count(int32_t* count) {
  return eps::capi::Guarded("eps_engine_device_count", [&] {
    if (count == nullptr) return Refuse("eps_engine_device_count", "count is null");
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      eps::gpu::ClearFailedCall();  // no device is not an error here
      n = 0;
    }
    *count = n;
    return 0;
  });
}

int eps_engine_preload(int32_t device) {
  return eps::capi::Guarded("eps_engine_preload", [&] {
    eps::client::DeviceScope scope;  // the caller's current device is restored on return
    if (int rc = Report(scope.Enter(device)); rc != 0) return rc;
    if (int rc = Report(eps::gpu::PreloadStreamOps()); rc != 0) return rc;
    return Report(eps::client::PreloadEngineOutputs());
  });
}

int eps_engine_signal_inputs_ready(uint64_t stream, uint64_t flags, uint64_t step) {
  return eps::capi::Guarded("eps_engine_signal_inputs_ready", [&] {
    if (flags == 0) return Refuse("eps_engine_signal_inputs_ready", "flags is null");
    if (int rc = CheckAligned("eps_engine_signal_inputs_ready", "flags", flags, 8); rc != 0) {
      return rc;
    }
    return Report(eps::gpu::StreamWriteCounter(Stream(stream), Ptr<uint64_t>(flags), step));
  });
}

int eps_engine_wait_selection(uint64_t stream, uint64_t flags, uint64_t step) {
  return eps::capi::Guarded("eps_engine_wait_selection", [&] {
    if (flags == 0) return Refuse("eps_engine_wait_selection", "flags is null");
    if (int rc = CheckAligned("eps_engine_wait_selection", "flags", flags, 8); rc != 0) return rc;
    return Report(eps::gpu::StreamWaitCounter(Stream(stream), Ptr<uint64_t>(flags) + 1, step));
  });
}

int eps_engine_wait_counter(uint64_t stream, uint64_t counter, uint64_t value) {
  return eps::capi::Guarded("eps_engine_wait_counter", [&] {
    if (counter == 0) return Refuse("eps_engine_wait_counter", "counter is null");
    if (int rc = CheckAligned("eps_engine_wait_counter", "counter", counter, 8); rc != 0) return rc;
    return Report(eps::gpu::StreamWaitCounter(Stream(stream), Ptr<uint64_t>(counter), value));
  });
}

int eps_engine_release_dense(int32_t device, uint64_t visit_count, int64_t n, uint64_t flags,
                             uint64_t step, uint64_t stream) {
  return eps::capi::Guarded("eps_engine_release_dense", [&] {
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
  });
}

namespace {
// n floats past what a byte count holds: n * 4 wrapped to a small size, and a call that
// cleared nothing, or a few bytes, answered 0.
std::string TooMany(int64_t n) {
  return absl::StrCat("n=", n, " floats are more bytes than an address space holds (at most ",
                      eps::gpu::kMaxFeedbackEntries, ")");
}
}  // namespace

int eps_engine_clear_feedback(int32_t device, uint64_t feedback, int64_t n, uint64_t stream) {
  return eps::capi::Guarded("eps_engine_clear_feedback", [&] {
    if (n < 0) return Refuse("eps_engine_clear_feedback", absl::StrCat("n=", n, " is negative"));
    if (n > eps::gpu::kMaxFeedbackEntries) return Refuse("eps_engine_clear_feedback", TooMany(n));
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
  });
}

int eps_engine_watchdog_clear_feedback(EpsEngineWatchdog* w, uint64_t feedback, int64_t n) {
  return eps::capi::Guarded("eps_engine_watchdog_clear_feedback", [&] {
    // The buffer before the handle (either refusal is INVALID_ARGUMENT): its checks need no
    // watchdog, so they are tested without a device.
    if (n < 0 || (n > 0 && feedback == 0)) {
      return Refuse("eps_engine_watchdog_clear_feedback",
                    absl::StrCat("n=", n, " must be >= 0 and feedback non-null when n > 0"));
    }
    if (n > eps::gpu::kMaxFeedbackEntries) {
      return Refuse("eps_engine_watchdog_clear_feedback", TooMany(n));
    }
    if (int rc = CheckAligned("eps_engine_watchdog_clear_feedback", "feedback", feedback,
                              alignof(float));
        rc != 0) {
      return rc;
    }
    if (w == nullptr) {
      return Refuse("eps_engine_watchdog_clear_feedback", "the watchdog is null (destroyed?)");
    }
    return Report(w->watchdog->Run("eps_engine_watchdog_clear_feedback",
                                   [&](eps::client::SelectionWatchdog&) {
                                     absl::MutexLock lock(&w->feedback_mu);
                                     w->feedback = Ptr<float>(feedback);
                                     w->feedback_n = n;
                                     return absl::OkStatus();
                                   }));
  });
}

int eps_engine_watchdog_create(int32_t device, uint64_t visit_count, int64_t n, uint64_t flags,
                               int64_t timeout_us, EpsEngineWatchdog** out) {
  return eps::capi::Guarded("eps_engine_watchdog_create", [&] {
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
    if (int rc = CheckAligned("eps_engine_watchdog_create", "visit_count", visit_count, 4);
        rc != 0) {
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
    if (const cudaError_t err = cudaMallocHost(&w->host_done, sizeof(uint64_t));
        err != cudaSuccess) {
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
  });
}

int eps_engine_watchdog_arm(EpsEngineWatchdog* w, uint64_t step) {
  return eps::capi::Guarded("eps_engine_watchdog_arm", [&] {
    // The step before the handle (either refusal is INVALID_ARGUMENT), so that its check is
    // tested without a device. 0 is the watchdog's "nothing armed": taken as a step, it
    // once dropped the armed step's watch and returned 0.
    if (step == 0) return Refuse("eps_engine_watchdog_arm", "step=0: steps start at 1");
    if (w == nullptr) return Refuse("eps_engine_watchdog_arm", "the watchdog is null (destroyed?)");
    return Report(
        w->watchdog->Run("eps_engine_watchdog_arm",
                         [step](eps::client::SelectionWatchdog& dog) { return dog.Arm(step); }));
  });
}

uint64_t eps_engine_watchdog_releases(EpsEngineWatchdog* w) {
  return eps::capi::GuardedCount("eps_engine_watchdog_releases", [&]() -> uint64_t {
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
  });
}

void eps_engine_watchdog_destroy(EpsEngineWatchdog* w) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  delete w;
}

int eps_engine_flash_attention_views(uint64_t visit_blocks, uint64_t visit_count, int32_t layers,
                                     int64_t max_batch, int32_t lists, int64_t max_blocks,
                                     uint64_t engine_table, int64_t table_stride,
                                     uint64_t context_tokens, int64_t batch, int32_t block_size,
                                     int64_t cache_blocks, uint64_t block_table_out,
                                     uint64_t seqused_out, uint64_t refused_out, uint64_t stream) {
  return eps::capi::Guarded("eps_engine_flash_attention_views", [&] {
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
  });
}

int eps_engine_flashinfer_fixed(uint64_t visit_blocks, uint64_t visit_count, int32_t layers,
                                int64_t max_batch, int32_t lists, int64_t max_blocks,
                                uint64_t engine_table, int64_t table_stride,
                                uint64_t context_tokens, int64_t batch, int32_t block_size,
                                int64_t cache_blocks, uint64_t indptr, int64_t nnz,
                                uint64_t indices_out, uint64_t last_page_len_out,
                                uint64_t mismatched, uint64_t stream) {
  return eps::capi::Guarded("eps_engine_flashinfer_fixed", [&] {
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
  });
}

}  // extern "C"
