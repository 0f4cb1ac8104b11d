// The C ABI of engine_capi.h over gpu/summary.h and engine_summary_queue.h: the device
// summary writer's and its queue's entry points, conversions and error codes only. Every
// entry point runs in capi::Guarded (a caller's n sizes the host vectors here).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "client/cpp/capi_status.h"
#include "client/cpp/device_scope.h"
#include "client/cpp/engine_capi.h"
#include "client/cpp/engine_capi_args.h"
#include "client/cpp/engine_summary_queue.h"
#include "core/layout.h"
#include "gpu/cuda_check.h"
#include "gpu/summary.h"

namespace {

using eps::capi::Ptr;
using eps::capi::Refuse;
using eps::capi::Report;
using eps::capi::Stream;

// The appends array of (appends, n): n in [0, the writer's kMaxAppends], and the array
// non-null when n > 0. Checked before the host copy of the array is sized by n.
int CheckAppends(const char* call, const EpsKeyAppend* appends, int64_t n) {
  if (n < 0) return Refuse(call, absl::StrCat("n=", n, " is negative"));
  if (n > eps::gpu::DeviceSummaryWriter::kMaxAppends) {
    return Refuse(call,
                  absl::StrCat("n=", n, " exceeds the ", eps::gpu::DeviceSummaryWriter::kMaxAppends,
                               " appends of one call"));
  }
  if (n > 0 && appends == nullptr) return Refuse(call, absl::StrCat("appends is null, n=", n));
  return 0;
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

// The caller checked n (in [0, kMaxRuns], `in` non-null when n > 0).
std::vector<eps::gpu::RecordRun> RecordRuns(const EpsRecordRun* in, int64_t n) {
  std::vector<eps::gpu::RecordRun> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = {Ptr<float>(in[i].first), in[i].records};
  return out;
}

}  // namespace

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

int eps_engine_summary_writer_create(const EpsEngineModel* m, int32_t device,
                                     EpsSummaryWriter** out) {
  return eps::capi::Guarded("eps_engine_summary_writer_create", [&] {
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
  });
}

int eps_engine_summary_append(EpsSummaryWriter* w, const EpsKeyAppend* appends, int64_t n,
                              int32_t key_dtype, uint64_t stream) {
  return eps::capi::Guarded("eps_engine_summary_append", [&] {
    const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
    if (w == nullptr) return Refuse("eps_engine_summary_append", "the writer is null (destroyed?)");
    if (int rc = CheckAppends("eps_engine_summary_append", appends, n); rc != 0) return rc;
    absl::StatusOr<eps::DType> dtype = KeyDType(key_dtype);
    if (!dtype.ok()) return Report(dtype.status());
    return Report(w->writer->Append(Appends(appends, n), *dtype, Stream(stream)));
  });
}

int eps_engine_summary_reset(EpsSummaryWriter* w, const EpsRecordRun* runs, int64_t n,
                             uint64_t stream) {
  return eps::capi::Guarded("eps_engine_summary_reset", [&] {
    const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
    if (w == nullptr) return Refuse("eps_engine_summary_reset", "the writer is null (destroyed?)");
    if (n < 0) return Refuse("eps_engine_summary_reset", absl::StrCat("n=", n, " is negative"));
    if (n > 0 && runs == nullptr) {
      return Refuse("eps_engine_summary_reset", absl::StrCat("runs is null, n=", n));
    }
    if (n > eps::gpu::DeviceSummaryWriter::kMaxRuns) {
      return Refuse("eps_engine_summary_reset",
                    absl::StrCat("n=", n, " exceeds the ", eps::gpu::DeviceSummaryWriter::kMaxRuns,
                                 " runs of one call"));
    }
    return Report(w->writer->Reset(RecordRuns(runs, n), Stream(stream)));
  });
}

int eps_engine_summary_writer_record_words(const EpsSummaryWriter* w, int32_t* out) {
  return eps::capi::Guarded("eps_engine_summary_writer_record_words", [&] {
    if (w == nullptr) {
      return Refuse("eps_engine_summary_writer_record_words", "the writer is null (destroyed?)");
    }
    if (out == nullptr) return Refuse("eps_engine_summary_writer_record_words", "out is null");
    *out = w->record_words;
    return 0;
  });
}

void eps_engine_summary_writer_destroy(EpsSummaryWriter* w) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  delete w;
}

int eps_engine_summary_queue_create(EpsSummaryWriter* writer, int32_t device,
                                    EpsSummaryQueue** out) {
  return eps::capi::Guarded("eps_engine_summary_queue_create", [&] {
    const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
    if (writer == nullptr) {
      return Refuse("eps_engine_summary_queue_create", "the writer is null (destroyed?)");
    }
    if (out == nullptr) return Refuse("eps_engine_summary_queue_create", "out is null");
    auto q = eps::client::SummaryQueue::Create(writer->writer, device);
    if (!q.ok()) return Report(q.status());
    *out = new EpsSummaryQueue{std::move(*q)};
    return 0;
  });
}

int eps_engine_summary_queue_submit(EpsSummaryQueue* q, const EpsKeyAppend* appends, int64_t n,
                                    int32_t key_dtype, uint64_t after_stream, uint64_t step) {
  return eps::capi::Guarded("eps_engine_summary_queue_submit", [&] {
    const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
    if (q == nullptr)
      return Refuse("eps_engine_summary_queue_submit", "the queue is null (destroyed?)");
    int rc = CheckAppends("eps_engine_summary_queue_submit", appends, n);
    absl::StatusOr<eps::DType> dtype = KeyDType(key_dtype);
    if (rc == 0 && !dtype.ok()) rc = Report(dtype.status());
    std::vector<eps::gpu::KeyAppend> copied;
    if (rc == 0) {
      try {
        copied = Appends(appends, n);
      } catch (...) {
        rc = eps::capi::ReportCurrentException("eps_engine_summary_queue_submit");
      }
    }
    if (rc != 0) {
      // Refused appends still raise the counter (engine_capi.h): a stream waiting for this
      // step must not hang. The refusal, already the thread's last error, is what returns.
      (void)q->queue->Submit({}, eps::DType::kFloat32, Stream(after_stream), step);
      return rc;
    }
    return Report(q->queue->Submit(std::move(copied), *dtype, Stream(after_stream), step));
  });
}

int eps_engine_summary_queue_wait(EpsSummaryQueue* q, uint64_t stream, uint64_t step) {
  return eps::capi::Guarded("eps_engine_summary_queue_wait", [&] {
    const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
    if (q == nullptr)
      return Refuse("eps_engine_summary_queue_wait", "the queue is null (destroyed?)");
    return Report(q->queue->WaitSummaries(Stream(stream), step));
  });
}

int eps_engine_summary_queue_drain(EpsSummaryQueue* q) {
  return eps::capi::Guarded("eps_engine_summary_queue_drain", [&] {
    const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
    if (q == nullptr)
      return Refuse("eps_engine_summary_queue_drain", "the queue is null (destroyed?)");
    return Report(q->queue->Drain());
  });
}

uint64_t eps_engine_summary_queue_errors(EpsSummaryQueue* q, char* buf, int64_t buf_len) {
  return eps::capi::GuardedCount("eps_engine_summary_queue_errors", [&]() -> uint64_t {
    // The queue reads its device's skipped-append counter on its device.
    const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
    std::string message;
    uint64_t errors = 0;
    if (q == nullptr) {
      Refuse("eps_engine_summary_queue_errors", "the queue is null (destroyed?)");
      message = eps::capi::LastError();
    } else {
      errors = q->queue->errors(&message);
    }
    if (buf != nullptr && buf_len > 0) {
      const size_t n = std::min<size_t>(message.size(), static_cast<size_t>(buf_len - 1));
      std::memcpy(buf, message.data(), n);
      buf[n] = '\0';
    }
    return errors;
  });
}

void eps_engine_summary_queue_destroy(EpsSummaryQueue* q) {
  const eps::client::DeviceScope scope(eps::client::RestoreCurrentDevice{});
  delete q;
}

}  // extern "C"
