#include "service/session_buffers.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "service/convert.h"

namespace eps::service {
namespace {

// The contract's names are the SharedBuffers field names (session_attach_test checks).
const google::protobuf::FieldDescriptor* FieldOf(const BufferSpec& spec) {
  return v1::SharedBuffers::descriptor()->FindFieldByName(spec.name);
}

// The descriptor of `spec` (the default, "memory is not set", when absent).
const v1::MemoryDescriptor& DescriptorOf(const v1::SharedBuffers& b, const BufferSpec& spec) {
  return static_cast<const v1::MemoryDescriptor&>(b.GetReflection()->GetMessage(b, FieldOf(spec)));
}

bool HasDescriptor(const v1::SharedBuffers& b, const BufferSpec& spec) {
  return b.GetReflection()->HasField(b, FieldOf(spec));
}

// The input buffer a write targets; null for a target that is not a writable input.
const MappedTensor* WriteTarget(const SessionBuffers& b, v1::BufferWrite::Target target) {
  switch (target) {
    case v1::BufferWrite::TARGET_SUMMARY_POOL:
      return &b[SharedBuffer::kSummaryPool];
    case v1::BufferWrite::TARGET_GROUP_TABLE:
      return &b[SharedBuffer::kGroupTable];
    case v1::BufferWrite::TARGET_BLOCK_TABLE:
      return &b[SharedBuffer::kBlockTable];
    case v1::BufferWrite::TARGET_QUERIES:
      return &b[SharedBuffer::kQueries];
    case v1::BufferWrite::TARGET_COARSE_POOL:
    case v1::BufferWrite::TARGET_COARSE_TABLE:
      // Empty (null data) without a coarse level: not a target then.
      if (!b.has_coarse_level) return nullptr;
      return &b[target == v1::BufferWrite::TARGET_COARSE_POOL ? SharedBuffer::kCoarsePool
                                                              : SharedBuffer::kCoarseTable];
    default:
      return nullptr;
  }
}

}  // namespace

absl::StatusOr<SessionBuffers> ResolveSessionBuffers(const v1::SharedBuffers& b,
                                                     const SessionSpec& spec,
                                                     MappingCache& mappings) {
  const Granularity granularity = spec.output_granularity;
  BufferDims dims = BufferDims::For(spec.model, granularity);
  dims[Dim::kMaxBatch] = spec.max_batch;
  // Where an engine-chosen dimension was fixed ("group_table.shape[0]"), for messages.
  std::array<std::string, kDims> fixed_by;
  SessionBuffers buf;
  std::vector<std::pair<TensorSpec, MappedTensor>> tensors;
  for (const BufferSpec& contract : kBufferContract) {
    if (!BufferApplies(contract, spec.model)) {
      // A coarse buffer without a coarse level: the engine and epsd disagree on the
      // layout, and a step would ignore the records the engine writes.
      if (HasDescriptor(b, contract)) {
        return absl::InvalidArgumentError(
            absl::StrCat(contract.name, " is set, but layout.coarse_blocks=0 (no coarse level)"));
      }
      continue;
    }
    if (contract.coarse_level && !HasDescriptor(b, contract)) {
      return absl::InvalidArgumentError(absl::StrCat(
          contract.name, " is required: layout.coarse_blocks=", spec.model.coarse_blocks,
          " has a coarse level"));
    }
    if (contract.optional && !HasDescriptor(b, contract)) continue;
    TensorSpec t;
    t.name = contract.name;
    t.dtype = ToProto(contract.id == SharedBuffer::kQueries ? spec.query_dtype : contract.dtype);
    t.writable = contract.output;
    // The coarse pool holds records too, copied 16 bytes at a time on the device.
    if (contract.id == SharedBuffer::kSummaryPool || contract.id == SharedBuffer::kCoarsePool) {
      t.alignment = kSummaryPoolAlignment;
    }
    const std::vector<Dim> shape = DimsOf(contract, granularity);
    for (Dim dim : shape) {
      t.shape.push_back(dims[dim]);
      const std::string& at = fixed_by[static_cast<int>(dim)];
      t.dim_names.push_back(at.empty() ? DimName(dim) : at);
    }
    ASSIGN_OR_RETURN(MappedTensor tensor, ResolveTensor(DescriptorOf(b, contract), t, mappings));
    for (size_t i = 0; i < shape.size(); ++i) {
      if (dims[shape[i]] >= 0) continue;
      dims[shape[i]] = tensor.shape[i];
      fixed_by[static_cast<int>(shape[i])] = absl::StrCat(contract.name, ".shape[", i, "]");
    }
    if (contract.id == SharedBuffer::kSummaryPool && dims[Dim::kSlots] > INT32_MAX) {
      return absl::InvalidArgumentError("summary_pool.shape[0] exceeds the int32 slot range");
    }
    if (contract.id == SharedBuffer::kCoarsePool && dims[Dim::kCoarseSlots] > INT32_MAX) {
      return absl::InvalidArgumentError("coarse_pool.shape[0] exceeds the int32 slot range");
    }
    buf.tensors[static_cast<int>(contract.id)] = tensor;
    tensors.emplace_back(std::move(t), tensor);
  }
  buf.has_flags = b.has_flags();
  buf.has_feedback = b.has_feedback();
  buf.num_slots = dims[Dim::kSlots];
  buf.max_seqs = dims[Dim::kMaxSeqs];
  buf.max_groups = dims[Dim::kMaxGroups];
  buf.max_blocks = dims[Dim::kMaxBlocks];
  buf.has_coarse_level = spec.model.has_coarse_level();
  if (buf.has_coarse_level) {
    buf.coarse_slots = dims[Dim::kCoarseSlots];
    buf.max_coarse_groups = dims[Dim::kMaxCoarseGroups];
  }
  RETURN_IF_ERROR(CheckNoOverlap(tensors));
  // Inline lists go back in the reply, counted by visit_count: memory the engine can
  // rewrite while epsd reads it would decide how much of visit_blocks is read.
  if (buf[SharedBuffer::kVisitBlocks].is_inline != buf[SharedBuffer::kVisitCount].is_inline) {
    return absl::InvalidArgumentError(
        "visit_blocks and visit_count must both be inline_bytes (the lists come back in the "
        "reply) or both shared memory");
  }
  // Feedback is what the engine's attention writes between steps, and an inline buffer
  // cannot be written after Attach (it is no BufferWrite target): its zero-filled rest
  // would read as feedback 0 for every group, and after one step it would be all NaN.
  if (buf.has_feedback && buf[SharedBuffer::kFeedback].is_inline) {
    return absl::InvalidArgumentError(
        "feedback must be engine memory (host_shm or cuda_ipc): an inline_bytes buffer "
        "cannot be written after Attach");
  }
  for (const auto& [tensor_spec, tensor] : tensors) {
    if (spec.backend == BackendKind::kCuda && !tensor.is_device) {
      return absl::InvalidArgumentError(absl::StrCat(
          tensor_spec.name, " is host memory, but a cuda session needs every buffer as cuda_ipc"));
    }
  }
  return buf;
}

int64_t InlineReplyBound(const SessionSpec& spec, const SessionBuffers& buffers) {
  const MappedTensor& blocks = buffers[SharedBuffer::kVisitBlocks];
  if (!blocks.is_inline || blocks.is_device) return 0;
  const int64_t lists = spec.output_granularity == Granularity::kPerKvHead
                            ? static_cast<int64_t>(spec.model.num_kv_heads)
                            : int64_t{1};
  // A VisitList: its tag and length (6), layer, batch_index, kv_head (6 each), the packed
  // blocks' tag and length (6) and ids (5 each), visited_tokens (11).
  const int64_t per_list = 6 + 3 * 6 + 6 + 5 * buffers.max_blocks + 11;
  const int64_t reply_fields = 1024;  // step, done, this step's statistics
  return static_cast<int64_t>(spec.model.num_layers) * spec.max_batch * lists * per_list +
         reply_fields;
}

absl::Status ApplyInlineWrites(const google::protobuf::RepeatedPtrField<v1::BufferWrite>& writes,
                               const SessionBuffers& buffers) {
  for (int i = 0; i < writes.size(); ++i) {
    const v1::BufferWrite& w = writes[i];
    const MappedTensor* target = WriteTarget(buffers, w.target());
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
  in.summary_pool = b.data<const float>(SharedBuffer::kSummaryPool);
  in.num_slots = b.num_slots;
  in.group_table = b.data<const int32_t>(SharedBuffer::kGroupTable);
  in.block_table = b.data<const int32_t>(SharedBuffer::kBlockTable);
  in.max_seqs = b.max_seqs;
  in.max_groups = b.max_groups;
  in.max_blocks = b.max_blocks;
  if (b.has_coarse_level) {
    in.coarse_pool = b.data<const float>(SharedBuffer::kCoarsePool);
    in.coarse_slots = b.coarse_slots;
    in.coarse_table = b.data<const int32_t>(SharedBuffer::kCoarseTable);
    in.max_coarse_groups = b.max_coarse_groups;
  }
  // Engine memory, read and consumed (set to NaN) by the step: not in the estimate.
  if (b.has_feedback) in.feedback = b.data<float>(SharedBuffer::kFeedback);
  in.num_physical_blocks = spec.num_kv_blocks;
  in.queries = b[SharedBuffer::kQueries].data;
  in.query_dtype = spec.query_dtype;
  in.max_batch = spec.max_batch;
  in.rows = rows;
  return in;
}

StepOutputs StepOutputsOf(const SessionBuffers& b) {
  return {b.data<int32_t>(SharedBuffer::kVisitBlocks), b.data<int32_t>(SharedBuffer::kVisitCount)};
}

}  // namespace eps::service
