#include "client/cpp/engine_buffers.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace eps::client {
namespace {

uint64_t Align(uint64_t x) { return (x + 63) / 64 * 64; }

}  // namespace

absl::StatusOr<std::unique_ptr<EngineBuffers>> EngineBuffers::Create(const ModelLayout& model,
                                                                     const BufferShape& shape,
                                                                     const std::string& tag) {
  if (absl::Status s = model.Validate(); !s.ok()) return s;
  if (shape.num_slots < 1 || shape.max_seqs < 1 || shape.max_context < 1 || shape.max_batch < 1) {
    return absl::InvalidArgumentError("every BufferShape field must be >= 1");
  }
  static std::atomic<int> counter{0};
  auto b = std::unique_ptr<EngineBuffers>(new EngineBuffers());
  b->model_ = model;
  b->shape_ = shape;
  b->max_blocks_ = BlocksFor(shape.max_context, model.block_size);
  b->max_groups_ = GroupsFor(shape.max_context, model);
  b->record_words_ = SummaryLayout::For(model).record_words;
  b->lists_ = shape.granularity == Granularity::kPerKvHead ? model.num_kv_heads : 1;
  b->pool_words_ = shape.num_slots * model.num_layers * model.num_kv_heads * b->record_words_;
  uint64_t offset = 0;
  auto take = [&](uint64_t bytes) {
    const uint64_t at = offset;
    offset = Align(offset + bytes);
    return at;
  };
  b->off_pool_ = take(uint64_t(b->pool_words_) * 4);
  b->off_groups_ = take(uint64_t(shape.max_seqs) * b->max_groups_ * 4);
  b->off_blocks_ = take(uint64_t(shape.max_seqs) * b->max_blocks_ * 4);
  b->off_queries_ = take(uint64_t(model.num_layers) * shape.max_batch * model.num_q_heads *
                         model.head_dim * 4);
  b->off_visit_ = take(uint64_t(model.num_layers) * shape.max_batch * b->lists_ * b->max_blocks_ * 4);
  b->off_count_ = take(uint64_t(model.num_layers) * shape.max_batch * b->lists_ * 4);
  b->off_flags_ = take(16);
  b->size_ = offset;
  b->name_ = absl::StrCat("/eps-", tag, "-", getpid(), "-", counter.fetch_add(1));
  const int fd = shm_open(b->name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("shm_open ", b->name_, ": ", std::strerror(errno)));
  if (ftruncate(fd, static_cast<off_t>(b->size_)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(b->name_.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("ftruncate ", b->name_, ": ", std::strerror(err)));
  }
  void* addr = mmap(nullptr, b->size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (addr == MAP_FAILED) {
    shm_unlink(b->name_.c_str());
    return absl::InternalError(absl::StrCat("mmap ", b->name_, ": ", std::strerror(err)));
  }
  b->base_ = static_cast<std::byte*>(addr);
  b->pool_ = reinterpret_cast<float*>(b->base_ + b->off_pool_);
  return b;
}

EngineBuffers::~EngineBuffers() {
  if (base_ != nullptr) {
    munmap(base_, size_);
    shm_unlink(name_.c_str());
  }
}

v1::MemoryDescriptor EngineBuffers::Describe(uint64_t offset, std::initializer_list<int64_t> shape,
                                             v1::DType dtype) const {
  v1::MemoryDescriptor d;
  d.mutable_host_shm()->set_name(name_);
  d.mutable_host_shm()->set_size(size_);
  d.set_offset(offset);
  for (int64_t dim : shape) d.add_shape(dim);
  d.set_dtype(dtype);
  return d;
}

v1::SharedBuffers EngineBuffers::Descriptors() const {
  const ModelLayout& m = model_;
  v1::SharedBuffers s;
  *s.mutable_summary_pool() = Describe(
      off_pool_, {shape_.num_slots, m.num_layers, m.num_kv_heads, record_words_}, v1::DTYPE_FLOAT32);
  *s.mutable_group_table() = Describe(off_groups_, {shape_.max_seqs, max_groups_}, v1::DTYPE_INT32);
  *s.mutable_block_table() = Describe(off_blocks_, {shape_.max_seqs, max_blocks_}, v1::DTYPE_INT32);
  *s.mutable_queries() = Describe(
      off_queries_, {m.num_layers, shape_.max_batch, m.num_q_heads, m.head_dim}, v1::DTYPE_FLOAT32);
  if (lists_ == 1) {
    *s.mutable_visit_blocks() =
        Describe(off_visit_, {m.num_layers, shape_.max_batch, max_blocks_}, v1::DTYPE_INT32);
    *s.mutable_visit_count() = Describe(off_count_, {m.num_layers, shape_.max_batch}, v1::DTYPE_INT32);
  } else {
    *s.mutable_visit_blocks() = Describe(
        off_visit_, {m.num_layers, shape_.max_batch, lists_, max_blocks_}, v1::DTYPE_INT32);
    *s.mutable_visit_count() =
        Describe(off_count_, {m.num_layers, shape_.max_batch, lists_}, v1::DTYPE_INT32);
  }
  if (shape_.with_flags) *s.mutable_flags() = Describe(off_flags_, {2}, v1::DTYPE_UINT64);
  return s;
}

std::span<float> EngineBuffers::Record(int64_t slot, int layer, int kv_head) {
  const int64_t index = (slot * model_.num_layers + layer) * model_.num_kv_heads + kv_head;
  return {pool_ + index * record_words_, static_cast<size_t>(record_words_)};
}

std::span<int32_t> EngineBuffers::GroupRow(int64_t row) {
  return {reinterpret_cast<int32_t*>(base_ + off_groups_) + row * max_groups_,
          static_cast<size_t>(max_groups_)};
}

std::span<int32_t> EngineBuffers::BlockRow(int64_t row) {
  return {reinterpret_cast<int32_t*>(base_ + off_blocks_) + row * max_blocks_,
          static_cast<size_t>(max_blocks_)};
}

std::span<float> EngineBuffers::Query(int layer, int64_t batch_pos, int q_head) {
  const int64_t index = (layer * shape_.max_batch + batch_pos) * model_.num_q_heads + q_head;
  return {reinterpret_cast<float*>(base_ + off_queries_) + index * model_.head_dim,
          static_cast<size_t>(model_.head_dim)};
}

std::span<const int32_t> EngineBuffers::VisitBlocks(int layer, int64_t batch_pos, int list) const {
  const int64_t index = (layer * shape_.max_batch + batch_pos) * lists_ + list;
  return {reinterpret_cast<const int32_t*>(base_ + off_visit_) + index * max_blocks_,
          static_cast<size_t>(std::max(0, VisitCount(layer, batch_pos, list)))};
}

int32_t EngineBuffers::VisitCount(int layer, int64_t batch_pos, int list) const {
  const int64_t index = (layer * shape_.max_batch + batch_pos) * lists_ + list;
  return reinterpret_cast<const int32_t*>(base_ + off_count_)[index];
}

uint64_t EngineBuffers::selection_done() const {
  std::atomic_ref<uint64_t> done(reinterpret_cast<uint64_t*>(base_ + off_flags_)[1]);
  return done.load(std::memory_order_acquire);
}

}  // namespace eps::client
