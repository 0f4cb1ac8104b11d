#include "client/cpp/engine_buffers.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"

namespace eps::client {
absl::StatusOr<std::unique_ptr<EngineBuffers>> EngineBuffers::Create(const ModelLayout& model,
                                                                     const BufferShape& shape,
                                                                     const std::string& tag) {
  absl::StatusOr<BufferPlan> plan = BufferPlan::For(model, shape);
  if (!plan.ok()) return plan.status();
  static std::atomic<int> counter{0};
  auto b = std::unique_ptr<EngineBuffers>(new EngineBuffers(*std::move(plan)));
  const uint64_t size = b->plan_.size;
  // /eps-<tag>-<pid>-<n>, created exclusively. A name can be taken by an object a dead
  // process of the same pid left behind: a crashed engine restarted in its container, whose
  // /dev/shm outlives it, often gets its old pid back. Such a name is left alone (it may
  // not be stale) and a random suffix makes another.
  b->name_ = absl::StrCat("/eps-", tag, "-", getpid(), "-", counter.fetch_add(1));
  const std::string base = b->name_;
  int fd = shm_open(b->name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  for (int retry = 0; fd < 0 && errno == EEXIST && retry < 8; ++retry) {
    std::random_device entropy;
    b->name_ = absl::StrCat(base, "-", absl::Hex(uint64_t{entropy()} << 32 | entropy()));
    fd = shm_open(b->name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  }
  if (fd < 0)
    return absl::InternalError(absl::StrCat("shm_open ", b->name_, ": ", std::strerror(errno)));
  // posix_fallocate, not ftruncate alone: on tmpfs a truncated object is sparse, so a
  // /dev/shm too small for it (a container's 64 MiB) would surface as SIGBUS at the first
  // write of a page it cannot hold, here or in the engine, instead of as an error now.
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(size)); err != 0) {
    close(fd);
    shm_unlink(b->name_.c_str());
    return absl::ResourceExhaustedError(
        absl::StrCat("posix_fallocate ", b->name_, " (", size, " bytes): ", std::strerror(err),
                     err == ENOSPC ? " (is /dev/shm large enough? `df -h /dev/shm`)" : ""));
  }
  void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (addr == MAP_FAILED) {
    shm_unlink(b->name_.c_str());
    return absl::InternalError(absl::StrCat("mmap ", b->name_, ": ", std::strerror(err)));
  }
  b->base_ = static_cast<std::byte*>(addr);
  b->pool_ = b->At<float>(b->plan_.pool);
  if (shape.with_feedback) {
    // NaN: no group visited yet (a zero would read as a visited group's log mass).
    float* feedback = b->At<float>(b->plan_.feedback);
    std::fill_n(feedback, b->plan_.ElementsOf(SharedBuffer::kFeedback),
                std::numeric_limits<float>::quiet_NaN());
  }
  return b;
}

EngineBuffers::~EngineBuffers() {
  if (base_ != nullptr) {
    munmap(base_, plan_.size);
    shm_unlink(name_.c_str());
  }
}

v1::SharedBuffers EngineBuffers::Descriptors() const {
  v1::MemoryDescriptor memory;
  memory.mutable_host_shm()->set_name(name_);
  memory.mutable_host_shm()->set_size(plan_.size);
  return plan_.Descriptors(memory);
}

bool EngineBuffers::InModel(int layer, int kv_head) const {
  return layer >= 0 && layer < plan_.model.num_layers && kv_head >= 0 &&
         kv_head < plan_.model.num_kv_heads;
}

bool EngineBuffers::InBatch(int layer, int64_t batch_pos, int list) const {
  return layer >= 0 && layer < plan_.model.num_layers && batch_pos >= 0 &&
         batch_pos < plan_.shape.max_batch && list >= 0 && list < plan_.lists;
}

std::span<float> EngineBuffers::Record(int64_t slot, int layer, int kv_head) {
  if (slot < 0 || slot >= plan_.shape.num_slots || !InModel(layer, kv_head)) return {};
  return {pool_ + plan_.RecordIndex(slot, layer, kv_head), static_cast<size_t>(plan_.record_words)};
}

std::span<float> EngineBuffers::CoarseRecord(int64_t slot, int layer, int kv_head) {
  if (!plan_.model.has_coarse_level()) return {};
  if (slot < 0 || slot >= plan_.shape.coarse_slots || !InModel(layer, kv_head)) return {};
  return {At<float>(plan_.coarse_pool) + plan_.RecordIndex(slot, layer, kv_head),
          static_cast<size_t>(plan_.record_words)};
}

std::span<int32_t> EngineBuffers::CoarseRow(int64_t row) {
  if (!plan_.model.has_coarse_level() || row < 0 || row >= plan_.shape.max_seqs) return {};
  return {At<int32_t>(plan_.coarse_table) + row * plan_.max_coarse_groups,
          static_cast<size_t>(plan_.max_coarse_groups)};
}

std::span<float> EngineBuffers::FeedbackRow(int layer, int64_t row, int q_head) {
  if (!plan_.shape.with_feedback || layer < 0 || layer >= plan_.model.num_layers || row < 0 ||
      row >= plan_.shape.max_seqs || q_head < 0 || q_head >= plan_.model.num_q_heads) {
    return {};
  }
  return {At<float>(plan_.feedback) + plan_.FeedbackIndex(layer, row, q_head),
          static_cast<size_t>(plan_.max_groups)};
}

std::span<int32_t> EngineBuffers::GroupRow(int64_t row) {
  if (row < 0 || row >= plan_.shape.max_seqs) return {};
  return {At<int32_t>(plan_.groups) + row * plan_.max_groups,
          static_cast<size_t>(plan_.max_groups)};
}

std::span<int32_t> EngineBuffers::BlockRow(int64_t row) {
  if (row < 0 || row >= plan_.shape.max_seqs) return {};
  return {At<int32_t>(plan_.blocks) + row * plan_.max_blocks,
          static_cast<size_t>(plan_.max_blocks)};
}

std::span<float> EngineBuffers::Query(int layer, int64_t batch_pos, int q_head) {
  if (layer < 0 || layer >= plan_.model.num_layers || batch_pos < 0 ||
      batch_pos >= plan_.shape.max_batch || q_head < 0 || q_head >= plan_.model.num_q_heads) {
    return {};
  }
  return {At<float>(plan_.queries) + plan_.QueryIndex(layer, batch_pos, q_head),
          static_cast<size_t>(plan_.model.head_dim)};
}

std::span<const int32_t> EngineBuffers::VisitBlocks(int layer, int64_t batch_pos, int list) const {
  return Visits(layer, batch_pos, list).value_or(std::span<const int32_t>());
}

std::optional<std::span<const int32_t>> EngineBuffers::Visits(int layer, int64_t batch_pos,
                                                              int list) const {
  const int32_t count = VisitCount(layer, batch_pos, list);
  if (count < 0) return std::nullopt;
  // visit_count is shared memory epsd writes: a count past the row never reads past it.
  return std::span<const int32_t>(
      At<const int32_t>(plan_.visit) + plan_.ListIndex(layer, batch_pos, list) * plan_.max_blocks,
      static_cast<size_t>(std::min<int64_t>(count, plan_.max_blocks)));
}

int32_t EngineBuffers::VisitCount(int layer, int64_t batch_pos, int list) const {
  if (!InBatch(layer, batch_pos, list)) return -1;
  return At<const int32_t>(plan_.count)[plan_.ListIndex(layer, batch_pos, list)];
}

uint64_t EngineBuffers::selection_done() const {
  std::atomic_ref<uint64_t> done(At<uint64_t>(plan_.flags)[1]);
  return done.load(std::memory_order_acquire);
}

}  // namespace eps::client
