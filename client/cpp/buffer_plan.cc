#include "client/cpp/buffer_plan.h"

#include "absl/strings/str_cat.h"

namespace eps::client {
namespace {

v1::DType ProtoDType(DType dtype) {
  switch (dtype) {
    case DType::kInt32:
      return v1::DTYPE_INT32;
    case DType::kUInt64:
      return v1::DTYPE_UINT64;
    default:
      return v1::DTYPE_FLOAT32;  // the contract's only other type; queries are float32 here
  }
}

// The contract's names are the SharedBuffers field names.
v1::MemoryDescriptor* MutableDescriptor(v1::SharedBuffers& s, const BufferSpec& spec) {
  return static_cast<v1::MemoryDescriptor*>(s.GetReflection()->MutableMessage(
      &s, v1::SharedBuffers::descriptor()->FindFieldByName(spec.name)));
}

}  // namespace

absl::StatusOr<BufferPlan> BufferPlan::For(const ModelLayout& model, const BufferShape& shape) {
  if (absl::Status s = model.Validate(); !s.ok()) return s;
  if (shape.num_slots < 1 || shape.max_seqs < 1 || shape.max_context < 1 || shape.max_batch < 1) {
    return absl::InvalidArgumentError("every BufferShape field must be >= 1");
  }
  if (model.has_coarse_level() ? shape.coarse_slots < 1 : shape.coarse_slots != 0) {
    return absl::InvalidArgumentError(absl::StrCat("BufferShape.coarse_slots=", shape.coarse_slots,
                                                   " with coarse_blocks=", model.coarse_blocks,
                                                   ": want >= 1 with a coarse level, 0 without"));
  }
  BufferPlan p;
  p.model = model;
  p.shape = shape;
  p.max_blocks = BlocksFor(shape.max_context, model.block_size);
  p.max_groups = GroupsFor(shape.max_context, model);
  p.record_words = SummaryLayout::For(model).record_words;
  p.lists = shape.granularity == Granularity::kPerKvHead ? model.num_kv_heads : 1;
  p.dims = BufferDims::For(model, shape.granularity);
  p.dims[Dim::kSlots] = shape.num_slots;
  p.dims[Dim::kMaxSeqs] = shape.max_seqs;
  p.dims[Dim::kMaxGroups] = p.max_groups;
  p.dims[Dim::kMaxBlocks] = p.max_blocks;
  p.dims[Dim::kMaxBatch] = shape.max_batch;
  if (model.has_coarse_level()) {
    p.max_coarse_groups = CoarseGroupsFor(shape.max_context, model);
    p.dims[Dim::kCoarseSlots] = shape.coarse_slots;
    p.dims[Dim::kMaxCoarseGroups] = p.max_coarse_groups;
  }
  // Every buffer of the layout in the contract's order (flags too, used or not), each
  // aligned; the coarse ones only with a coarse level (their dims are unknown, -1, else),
  // feedback only when asked for (it is as large as max_seqs rows of scores).
  uint64_t offset = 0;
  for (const BufferSpec& spec : kBufferContract) {
    if (!BufferApplies(spec, model)) continue;
    if (spec.id == SharedBuffer::kFeedback && !shape.with_feedback) continue;
    const int i = static_cast<int>(spec.id);
    int64_t elements = 1;
    for (int64_t dim : ShapeOf(spec, p.dims, shape.granularity)) elements *= dim;
    p.offsets[i] = offset;
    p.elements[i] = elements;
    const uint64_t bytes = uint64_t(elements) * DTypeSize(spec.dtype);
    offset = (offset + bytes + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
  }
  p.size = offset;
  p.pool_words = p.elements[static_cast<int>(SharedBuffer::kSummaryPool)];
  const auto at = [&](SharedBuffer b) { return p.offsets[static_cast<int>(b)]; };
  p.pool = at(SharedBuffer::kSummaryPool);
  p.groups = at(SharedBuffer::kGroupTable);
  p.blocks = at(SharedBuffer::kBlockTable);
  p.queries = at(SharedBuffer::kQueries);
  p.visit = at(SharedBuffer::kVisitBlocks);
  p.count = at(SharedBuffer::kVisitCount);
  p.flags = at(SharedBuffer::kFlags);
  p.coarse_pool = at(SharedBuffer::kCoarsePool);
  p.coarse_table = at(SharedBuffer::kCoarseTable);
  p.coarse_pool_words = p.elements[static_cast<int>(SharedBuffer::kCoarsePool)];
  p.feedback = at(SharedBuffer::kFeedback);
  return p;
}

v1::SharedBuffers BufferPlan::Descriptors(const v1::MemoryDescriptor& memory) const {
  v1::SharedBuffers s;
  for (const BufferSpec& spec : kBufferContract) {
    if (!BufferApplies(spec, model)) continue;
    if (spec.id == SharedBuffer::kFlags && !shape.with_flags) continue;
    if (spec.id == SharedBuffer::kFeedback && !shape.with_feedback) continue;
    v1::MemoryDescriptor* d = MutableDescriptor(s, spec);
    *d = memory;
    d->clear_shape();
    d->clear_strides();
    d->set_offset(offsets[static_cast<int>(spec.id)]);
    for (int64_t dim : ShapeOf(spec, dims, shape.granularity)) d->add_shape(dim);
    d->set_dtype(ProtoDType(spec.dtype));
  }
  return s;
}

}  // namespace eps::client
