#include "service/session_spec.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "google/protobuf/descriptor.h"
#include "service/convert.h"
#include "service/cuda_backend.h"

namespace eps::service {
namespace {

// The cuda session's device as the request names it (docs/api-memory.md §3.7), checked
// without CUDA: a 16-byte device_uuid, or the ordinal of summary_pool.cuda_ipc (of
// `device` without one), which `device` and every cuda_ipc.device must repeat, since
// a step's kernels run on one device. Returns that ordinal (none for a UUID).
absl::StatusOr<std::optional<int>> RequestedDevice(const v1::AttachRequest& req) {
  if (!req.device_uuid().empty()) {
    if (req.device_uuid().size() != 16) {
      return absl::InvalidArgumentError(
          absl::StrCat("device_uuid has ", req.device_uuid().size(), " bytes, want 16"));
    }
    return std::nullopt;  // the ordinals are the engine's own, not checked
  }
  const v1::SharedBuffers& b = req.buffers();
  const int device =
      b.summary_pool().has_cuda_ipc() ? b.summary_pool().cuda_ipc().device() : req.device();
  if (device < 0) {
    return absl::InvalidArgumentError(absl::StrCat("device=", device, " is negative"));
  }
  if (req.device() != 0 && req.device() != device) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device=", req.device(), " differs from buffers.summary_pool.cuda_ipc.device=", device));
  }
  const google::protobuf::Descriptor* fields = v1::SharedBuffers::descriptor();
  for (int i = 0; i < fields->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = fields->field(i);
    if (!b.GetReflection()->HasField(b, field)) continue;
    const auto& d =
        static_cast<const v1::MemoryDescriptor&>(b.GetReflection()->GetMessage(b, field));
    if (d.has_cuda_ipc() && d.cuda_ipc().device() != device) {
      return absl::InvalidArgumentError(absl::StrCat(
          "buffers.", field->name(), ".cuda_ipc.device=", d.cuda_ipc().device(),
          " differs from the session's device ", device, ": a session's buffers live on one GPU"));
    }
  }
  return device;
}

// epsd's ordinal of the requested device: the UUID's, or the ordinal when epsd has it.
absl::StatusOr<int> ResolveDevice(const v1::AttachRequest& req, std::optional<int> requested) {
  if (!requested.has_value()) return CudaDeviceWithUuid(req.device_uuid());
  const int count = CudaDeviceCount();
  if (*requested >= count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device=", *requested, " is not one of epsd's CUDA devices (ordinals 0-", count - 1, ")"));
  }
  return *requested;
}

}  // namespace

absl::StatusOr<SessionSpec> SessionSpecFromProto(const v1::AttachRequest& req,
                                                 const ServerConfig& config) {
  SessionSpec s;
  if (req.engine_id().empty() || req.engine_id().size() > 256) {
    return absl::InvalidArgumentError("engine_id must be 1-256 bytes");
  }
  s.engine_id = req.engine_id();
  ASSIGN_OR_RETURN(s.model, LayoutFromProto(req.layout(), config.group_blocks, config.sketch_dim));
  if (req.layout().query_dtype() == v1::DTYPE_UNSPECIFIED) {
    s.query_dtype = DType::kFloat32;
  } else {
    absl::StatusOr<DType> q = FromProto(req.layout().query_dtype());
    if (!q.ok() || *q == DType::kInt32 || *q == DType::kInt8 || *q == DType::kUInt64) {
      return absl::InvalidArgumentError(
          absl::StrCat("layout.query_dtype=", ProtoDTypeName(req.layout().query_dtype()),
                       " is not a float type"));
    }
    s.query_dtype = *q;
  }
  if (req.max_batch() < 1) return absl::InvalidArgumentError("max_batch=0 must be >= 1");
  if (req.max_batch() > config.max_batch) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "max_batch=", req.max_batch(), " exceeds the server's --max-batch=", config.max_batch));
  }
  s.max_batch = req.max_batch();
  if (req.num_kv_blocks() > static_cast<uint64_t>(INT32_MAX) + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_blocks=", req.num_kv_blocks(), " exceeds the int32 block id range"));
  }
  s.num_kv_blocks = req.num_kv_blocks() == 0 ? -1 : static_cast<int64_t>(req.num_kv_blocks());
  s.lease_ms =
      req.lease_ms() == 0 ? config.lease_ms : std::clamp<uint32_t>(req.lease_ms(), 50, 3600000);

  // Backend: asked for, or the server's --backend; auto follows the memory kind.
  ASSIGN_OR_RETURN(s.backend, BackendFromProto(req.backend()));
  if (s.backend == BackendKind::kAuto) {
    s.backend =
        config.backend == BackendKind::kCuda ||
                (config.backend == BackendKind::kAuto &&
                 req.buffers().summary_pool().memory_case() == v1::MemoryDescriptor::kCudaIpc)
            ? BackendKind::kCuda
            : BackendKind::kCpu;
  }
  if (s.backend == BackendKind::kCuda) {
    ASSIGN_OR_RETURN(const std::optional<int> requested, RequestedDevice(req));
    if (!CudaBackendBuilt() || !CudaDevicePresent()) {
      return absl::FailedPreconditionError(
          absl::StrCat("backend BACKEND_CUDA is not available: ", CudaUnavailableReason()));
    }
    ASSIGN_OR_RETURN(s.device, ResolveDevice(req, requested));
  } else if (!req.device_uuid().empty()) {
    return absl::InvalidArgumentError(
        "device_uuid names a CUDA device, but the session runs on the cpu backend over host "
        "memory");
  } else if (req.device() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device=", req.device(),
                     " names a CUDA device, but the session runs on the cpu backend over host "
                     "memory"));
  }
  s.output_granularity = req.buffers().visit_blocks().shape_size() == 4 ? Granularity::kPerKvHead
                                                                        : Granularity::kUnion;
  return s;
}

absl::StatusOr<SelectPolicy> SessionPolicy(const SessionSpec& spec, const v1::AttachRequest& req,
                                           const SelectPolicy& server_defaults) {
  ASSIGN_OR_RETURN(SelectPolicy policy, MergeOptions(server_defaults, req.options()));
  if (req.options().granularity() == v1::GRANULARITY_UNSPECIFIED) {
    policy.granularity = spec.output_granularity;
  } else if (policy.granularity != spec.output_granularity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.granularity=", GranularityName(policy.granularity), " does not match the rank-",
        req.buffers().visit_blocks().shape_size(), " visit_blocks buffer"));
  }
  if (policy.heads == HeadMode::kRetrieval && policy.retrieval_heads.empty()) {
    return absl::InvalidArgumentError(
        "heads=retrieval needs options.retrieval_heads ([layers * q_heads] marks)");
  }
  RETURN_IF_ERROR(policy.Validate(spec.model));
  return policy;
}

}  // namespace eps::service
