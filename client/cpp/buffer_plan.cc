#include "client/cpp/buffer_plan.h"

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace eps::client {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

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
  // epsd's own limits (docs/api-memory.md §3): slots, table rows and batch positions are int32
  // indices, block ids and visit counts int32, so a list holds at most 2^31-1 blocks.
  const std::pair<const char*, int64_t> counts[] = {
      {"num_slots", shape.num_slots}, {"max_seqs", shape.max_seqs}, {"max_batch", shape.max_batch}};
  for (const auto& [name, value] : counts) {
    if (value < 1 || value > kInt32Max) {
      return absl::InvalidArgumentError(
          absl::StrCat("BufferShape.", name, "=", value, " is not in [1, 2^31-1]"));
    }
  }
  if (shape.max_context < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("BufferShape.max_context=", shape.max_context, " must be >= 1"));
  }
  if (BlocksFor(shape.max_context, model.block_size) > kInt32Max) {
    return absl::InvalidArgumentError(
        absl::StrCat("BufferShape.max_context=", shape.max_context, " is ",
                     BlocksFor(shape.max_context, model.block_size), " blocks of ",
                     model.block_size, " tokens: a list holds at most 2^31-1 blocks"));
  }
  if (shape.coarse_slots > kInt32Max) {
    return absl::InvalidArgumentError(
        absl::StrCat("BufferShape.coarse_slots=", shape.coarse_slots, " exceeds 2^31-1"));
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
  // feedback only when asked for (it is as large as max_seqs rows of scores). Each
  // product and sum is checked: fields within the bounds above can still multiply past
  // int64 (a plan that wrapped once mapped 1536 bytes for 2^62 slots' records), and the
  // whole allocation must fit an off_t.
  constexpr int64_t kMaxBytes = std::numeric_limits<int64_t>::max();
  int64_t offset = 0;
  for (const BufferSpec& spec : kBufferContract) {
    if (!BufferApplies(spec, model)) continue;
    if (spec.id == SharedBuffer::kFeedback && !shape.with_feedback) continue;
    const int i = static_cast<int>(spec.id);
    const std::vector<int64_t> dims = ShapeOf(spec, p.dims, shape.granularity);
    int64_t elements = 1, bytes = 0, end = 0;
    bool overflow = false;
    for (int64_t dim : dims) overflow |= __builtin_mul_overflow(elements, dim, &elements);
    overflow = overflow ||
               __builtin_mul_overflow(elements, int64_t{DTypeSize(spec.dtype)}, &bytes) ||
               __builtin_add_overflow(offset, bytes, &end) ||
               end > kMaxBytes - static_cast<int64_t>(kBufferAlignment);
    if (overflow) {
      return absl::InvalidArgumentError(
          absl::StrCat("BufferShape: ", spec.name, " [", absl::StrJoin(dims, ", "), "] at byte ",
                       offset, " takes the allocation past 2^63 bytes"));
    }
    p.offsets[i] = static_cast<uint64_t>(offset);
    p.elements[i] = elements;
    offset = (end + kBufferAlignment - 1) / kBufferAlignment * kBufferAlignment;
  }
  p.size = static_cast<uint64_t>(offset);
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
