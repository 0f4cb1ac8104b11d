#include "core/buffer_contract.h"

namespace eps {

const char* DimName(Dim dim) {
  static constexpr const char* kNames[kDims] = {
      "slots",      "num_layers", "num_kv_heads", "record_words",     "max_seqs",
      "max_groups", "max_blocks", "max_batch",    "num_q_heads",      "head_dim",
      "lists",      "counters",   "coarse_slots", "max_coarse_groups"};
  return kNames[static_cast<int>(dim)];
}

std::vector<Dim> DimsOf(const BufferSpec& spec, Granularity granularity) {
  std::vector<Dim> dims;
  for (int i = 0; i < spec.rank; ++i) {
    if (spec.dims[i] == Dim::kLists && granularity == Granularity::kUnion) continue;
    dims.push_back(spec.dims[i]);
  }
  return dims;
}

BufferDims BufferDims::For(const ModelLayout& model, Granularity granularity) {
  BufferDims d;
  d.value.fill(-1);
  d[Dim::kNumLayers] = model.num_layers;
  d[Dim::kNumKvHeads] = model.num_kv_heads;
  d[Dim::kRecordWords] = SummaryLayout::For(model).record_words;
  d[Dim::kNumQHeads] = model.num_q_heads;
  d[Dim::kHeadDim] = model.head_dim;
  d[Dim::kLists] = granularity == Granularity::kPerKvHead ? model.num_kv_heads : 1;
  d[Dim::kCounters] = 2;
  return d;
}

std::vector<int64_t> ShapeOf(const BufferSpec& spec, const BufferDims& dims,
                             Granularity granularity) {
  std::vector<int64_t> shape;
  for (Dim dim : DimsOf(spec, granularity)) shape.push_back(dims[dim]);
  return shape;
}

}  // namespace eps
