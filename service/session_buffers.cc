#include "service/session_buffers.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "service/convert.h"

namespace eps::service {
namespace {

// The input buffer a write targets; null for a target that is not a writable input.
const HostTensor* WriteTarget(const SessionBuffers& b, v1::BufferWrite::Target target) {
  switch (target) {
    case v1::BufferWrite::TARGET_SUMMARY_POOL:
      return &b.summary_pool;
    case v1::BufferWrite::TARGET_GROUP_TABLE:
      return &b.group_table;
    case v1::BufferWrite::TARGET_BLOCK_TABLE:
      return &b.block_table;
    case v1::BufferWrite::TARGET_QUERIES:
      return &b.queries;
    default:
      return nullptr;
  }
}

}  // namespace

absl::StatusOr<SessionBuffers> ResolveSessionBuffers(const v1::SharedBuffers& b,
                                                     const SessionSpec& spec,
                                                     MappingCache& mappings) {
  // Shapes follow from the layout, the batch and the group/block tables.
  const ModelLayout& m = spec.model;
  const SummaryLayout record = SummaryLayout::For(m);
  SessionBuffers buf;
  std::vector<std::pair<TensorSpec, HostTensor>> tensors;
  auto resolve = [&](const v1::MemoryDescriptor& desc, TensorSpec tensor_spec,
                     HostTensor* out) -> absl::Status {
    ASSIGN_OR_RETURN(*out, ResolveTensor(desc, tensor_spec, mappings));
    tensors.emplace_back(std::move(tensor_spec), *out);
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(resolve(b.summary_pool(),
                          {"summary_pool",
                           v1::DTYPE_FLOAT32,
                           {-1, m.num_layers, m.num_kv_heads, record.record_words},
                           {"slots", "num_layers", "num_kv_heads", "record_words"}},
                          &buf.summary_pool));
  buf.num_slots = buf.summary_pool.shape[0];
  if (buf.num_slots > INT32_MAX) {
    return absl::InvalidArgumentError("summary_pool.shape[0] exceeds the int32 slot range");
  }
  RETURN_IF_ERROR(resolve(b.group_table(),
                          {"group_table", v1::DTYPE_INT32, {-1, -1}, {"max_seqs", "max_groups"}},
                          &buf.group_table));
  buf.max_seqs = buf.group_table.shape[0];
  buf.max_groups = buf.group_table.shape[1];
  RETURN_IF_ERROR(resolve(
      b.block_table(),
      {"block_table", v1::DTYPE_INT32, {buf.max_seqs, -1}, {"group_table.shape[0]", "max_blocks"}},
      &buf.block_table));
  buf.max_blocks = buf.block_table.shape[1];
  const int64_t batch = spec.max_batch;
  RETURN_IF_ERROR(resolve(b.queries(),
                          {"queries",
                           ToProto(spec.query_dtype),
                           {m.num_layers, batch, m.num_q_heads, m.head_dim},
                           {"num_layers", "max_batch", "num_q_heads", "head_dim"}},
                          &buf.queries));
  if (spec.output_granularity == Granularity::kPerKvHead) {
    RETURN_IF_ERROR(resolve(b.visit_blocks(),
                            {"visit_blocks",
                             v1::DTYPE_INT32,
                             {m.num_layers, batch, m.num_kv_heads, buf.max_blocks},
                             {"num_layers", "max_batch", "num_kv_heads", "max_blocks"},
                             true},
                            &buf.visit_blocks));
    RETURN_IF_ERROR(resolve(b.visit_count(),
                            {"visit_count",
                             v1::DTYPE_INT32,
                             {m.num_layers, batch, m.num_kv_heads},
                             {"num_layers", "max_batch", "num_kv_heads"},
                             true},
                            &buf.visit_count));
  } else {
    RETURN_IF_ERROR(resolve(b.visit_blocks(),
                            {"visit_blocks",
                             v1::DTYPE_INT32,
                             {m.num_layers, batch, buf.max_blocks},
                             {"num_layers", "max_batch", "max_blocks"},
                             true},
                            &buf.visit_blocks));
    RETURN_IF_ERROR(resolve(
        b.visit_count(),
        {"visit_count", v1::DTYPE_INT32, {m.num_layers, batch}, {"num_layers", "max_batch"}, true},
        &buf.visit_count));
  }
  if (b.has_flags()) {
    RETURN_IF_ERROR(resolve(b.flags(), {"flags", v1::DTYPE_UINT64, {2}, {"2"}, true}, &buf.flags));
    buf.has_flags = true;
  }
  RETURN_IF_ERROR(CheckNoOverlap(tensors));
  for (const auto& [tensor_spec, tensor] : tensors) {
    if (spec.backend == BackendKind::kCuda && !tensor.is_device) {
      return absl::InvalidArgumentError(absl::StrCat(
          tensor_spec.name, " is host memory, but a cuda session needs every buffer as cuda_ipc"));
    }
  }
  return buf;
}

absl::Status ApplyInlineWrites(const google::protobuf::RepeatedPtrField<v1::BufferWrite>& writes,
                               const SessionBuffers& buffers) {
  for (int i = 0; i < writes.size(); ++i) {
    const v1::BufferWrite& w = writes[i];
    const HostTensor* target = WriteTarget(buffers, w.target());
    if (target == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("writes[", i, "].target=", w.target(), " is not a writable input"));
    }
    if (!target->is_inline) {
      return absl::FailedPreconditionError(
          absl::StrCat("writes[", i, "] targets ", v1::BufferWrite::Target_Name(w.target()),
                       ", which lives in shared memory: write it there instead"));
    }
    uint64_t end = 0;
    if (__builtin_add_overflow(w.offset(), w.data().size(), &end) || end > target->bytes) {
      return absl::InvalidArgumentError(absl::StrCat("writes[", i, "]: offset ", w.offset(), " + ",
                                                     w.data().size(), " bytes exceeds the ",
                                                     target->bytes, "-byte buffer"));
    }
  }
  for (const v1::BufferWrite& w : writes) {
    std::memcpy(WriteTarget(buffers, w.target())->data + w.offset(), w.data().data(),
                w.data().size());
  }
  return absl::OkStatus();
}

StepInputs StepInputsOf(const SessionSpec& spec, const SessionBuffers& b,
                        std::span<const StepRow> rows) {
  StepInputs in;
  in.summary_pool = reinterpret_cast<const float*>(b.summary_pool.data);
  in.num_slots = b.num_slots;
  in.group_table = reinterpret_cast<const int32_t*>(b.group_table.data);
  in.block_table = reinterpret_cast<const int32_t*>(b.block_table.data);
  in.max_seqs = b.max_seqs;
  in.max_groups = b.max_groups;
  in.max_blocks = b.max_blocks;
  in.num_physical_blocks = spec.num_kv_blocks;
  in.queries = b.queries.data;
  in.query_dtype = spec.query_dtype;
  in.max_batch = spec.max_batch;
  in.rows = rows;
  return in;
}

StepOutputs StepOutputsOf(const SessionBuffers& b) {
  return {reinterpret_cast<int32_t*>(b.visit_blocks.data),
          reinterpret_cast<int32_t*>(b.visit_count.data)};
}

}  // namespace eps::service
