#include "client/cpp/buffer_plan.h"

namespace eps::client {
namespace {

constexpr uint64_t kAlign = 256;

v1::MemoryDescriptor Part(const v1::MemoryDescriptor& memory, uint64_t offset,
                          std::initializer_list<int64_t> shape, v1::DType dtype) {
  v1::MemoryDescriptor d = memory;
  d.clear_shape();
  d.clear_strides();
  d.set_offset(offset);
  for (int64_t dim : shape) d.add_shape(dim);
  d.set_dtype(dtype);
  return d;
}

}  // namespace

absl::StatusOr<BufferPlan> BufferPlan::For(const ModelLayout& model, const BufferShape& shape) {
  if (absl::Status s = model.Validate(); !s.ok()) return s;
  if (shape.num_slots < 1 || shape.max_seqs < 1 || shape.max_context < 1 || shape.max_batch < 1) {
    return absl::InvalidArgumentError("every BufferShape field must be >= 1");
  }
  BufferPlan p;
  p.model = model;
  p.shape = shape;
  p.max_blocks = BlocksFor(shape.max_context, model.block_size);
  p.max_groups = GroupsFor(shape.max_context, model);
  p.record_words = SummaryLayout::For(model).record_words;
  p.lists = shape.granularity == Granularity::kPerKvHead ? model.num_kv_heads : 1;
  p.pool_words = shape.num_slots * model.num_layers * model.num_kv_heads * p.record_words;
  uint64_t offset = 0;
  auto take = [&](uint64_t bytes) {
    const uint64_t at = offset;
    offset = (offset + bytes + kAlign - 1) / kAlign * kAlign;
    return at;
  };
  const uint64_t rows_by_layer = uint64_t(model.num_layers) * shape.max_batch;
  p.pool = take(uint64_t(p.pool_words) * 4);
  p.groups = take(uint64_t(shape.max_seqs) * p.max_groups * 4);
  p.blocks = take(uint64_t(shape.max_seqs) * p.max_blocks * 4);
  p.queries = take(rows_by_layer * model.num_q_heads * model.head_dim * 4);
  p.visit = take(rows_by_layer * p.lists * p.max_blocks * 4);
  p.count = take(rows_by_layer * p.lists * 4);
  p.flags = take(16);
  p.size = offset;
  return p;
}

v1::SharedBuffers BufferPlan::Descriptors(const v1::MemoryDescriptor& memory) const {
  const ModelLayout& m = model;
  v1::SharedBuffers s;
  *s.mutable_summary_pool() =
      Part(memory, pool, {shape.num_slots, m.num_layers, m.num_kv_heads, record_words},
           v1::DTYPE_FLOAT32);
  *s.mutable_group_table() = Part(memory, groups, {shape.max_seqs, max_groups}, v1::DTYPE_INT32);
  *s.mutable_block_table() = Part(memory, blocks, {shape.max_seqs, max_blocks}, v1::DTYPE_INT32);
  *s.mutable_queries() =
      Part(memory, queries, {m.num_layers, shape.max_batch, m.num_q_heads, m.head_dim},
           v1::DTYPE_FLOAT32);
  if (lists == 1) {
    *s.mutable_visit_blocks() =
        Part(memory, visit, {m.num_layers, shape.max_batch, max_blocks}, v1::DTYPE_INT32);
    *s.mutable_visit_count() =
        Part(memory, count, {m.num_layers, shape.max_batch}, v1::DTYPE_INT32);
  } else {
    *s.mutable_visit_blocks() =
        Part(memory, visit, {m.num_layers, shape.max_batch, lists, max_blocks}, v1::DTYPE_INT32);
    *s.mutable_visit_count() =
        Part(memory, count, {m.num_layers, shape.max_batch, lists}, v1::DTYPE_INT32);
  }
  if (shape.with_flags) *s.mutable_flags() = Part(memory, flags, {2}, v1::DTYPE_UINT64);
  return s;
}

}  // namespace eps::client
