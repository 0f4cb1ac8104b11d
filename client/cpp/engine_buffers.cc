#include "client/cpp/engine_buffers.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <limits>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "core/status.h"

namespace eps::client {
namespace {

// Where glibc's shm_open (and Python's) keeps every object on Linux.
constexpr char kShmDir[] = "/dev/shm";

// One descriptor, closed when it goes.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() {
    if (fd_ >= 0) close(fd_);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }

 private:
  const int fd_;
};

bool AllOf(absl::string_view s, bool (*in)(char), size_t max_size) {
  return !s.empty() && s.size() <= max_size && std::all_of(s.begin(), s.end(), in);
}

// Whether `entry` (a /dev/shm name) is one Create makes for `tag`: eps-<tag>-<pid>-<n>, or
// that with -<hex>: a pid of at most 7 digits (Linux's pid_max is at most 2^22), a count of
// at most 10 (a uint32) and exactly 16 lower-case hex digits (64 random bits, zero-padded;
// Python's token_hex(8) alike). The widths make the grammar unambiguous where one tag is
// another's prefix and a '-' (tags "a" and "a-1"): a name of one never reads as the other's
// (with a suffix of 1 to 16 digits, "eps-a-1-100-5", tag a-1's, read as tag a's pid 1,
// count 100, suffix 5).
bool NamedForTag(absl::string_view entry, const std::string& tag) {
  const std::string prefix = absl::StrCat("eps-", tag, "-");
  if (entry.substr(0, prefix.size()) != prefix) return false;
  const std::vector<absl::string_view> parts = absl::StrSplit(entry.substr(prefix.size()), '-');
  auto decimal = [](char c) { return absl::ascii_isdigit(static_cast<unsigned char>(c)); };
  auto hex = [](char c) {
    return absl::ascii_isdigit(static_cast<unsigned char>(c)) || (c >= 'a' && c <= 'f');
  };
  constexpr size_t kPidDigits = 7, kCountDigits = 10, kSuffixDigits = 16;
  return (parts.size() == 2 || parts.size() == 3) && AllOf(parts[0], decimal, kPidDigits) &&
         AllOf(parts[1], decimal, kCountDigits) &&
         (parts.size() == 2 ||
          (parts[2].size() == kSuffixDigits && AllOf(parts[2], hex, kSuffixDigits)));
}

// Whether neither the object's ctime nor its mtime is within `grace` of `now` (a clock set
// back makes an object younger: kept).
bool UnchangedFor(const struct stat& st, const timespec& now, std::chrono::seconds grace) {
  auto ns = [](const timespec& t) { return int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec; };
  const int64_t changed = std::max(ns(st.st_ctim), ns(st.st_mtim));
  return ns(now) - changed >= std::chrono::nanoseconds(grace).count();
}

bool SameInode(const struct stat& a, const struct stat& b) {
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

// A grace period below zero would make an object stale before its creator could lock it.
absl::Status CheckGrace(absl::string_view name, std::chrono::seconds grace) {
  if (grace.count() >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name, "=", grace.count(), "s must be >= 0 (a grace period in seconds)"));
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ReapStaleShm(const std::string& tag,
                                                      std::chrono::seconds grace) {
  RETURN_IF_ERROR(CheckGrace("grace", grace));
  std::vector<std::string> reaped;
  std::unique_ptr<DIR, int (*)(DIR*)> dir(opendir(kShmDir), closedir);
  if (dir == nullptr) return reaped;
  const int dir_fd = dirfd(dir.get());
  const uid_t uid = geteuid();
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);  // the clock of st_ctim and st_mtim
  while (const dirent* entry = readdir(dir.get())) {
    const char* name = entry->d_name;
    if (!NamedForTag(name, tag)) continue;
    // Checked before it is opened, without following a link: what is not a regular file of
    // this uid (a FIFO, whose open would wake a writer waiting on it, a device, a link,
    // another user's file) is never opened.
    struct stat checked {};
    if (fstatat(dir_fd, name, &checked, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(checked.st_mode) ||
        checked.st_uid != uid) {
      continue;
    }
    // O_NOFOLLOW | O_NONBLOCK | O_NOCTTY: what may have replaced the entry since is neither
    // followed, waited on nor made the controlling terminal, and is left unless it is the
    // very inode checked.
    const ScopedFd fd(
        openat(dir_fd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
    struct stat opened {};
    if (fd.get() < 0 || fstat(fd.get(), &opened) != 0 || !SameInode(opened, checked) ||
        !UnchangedFor(opened, now, grace)) {
      continue;
    }
    // Fails while anyone holds the object: its creator (LOCK_SH), or another reaper.
    if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) continue;
    // Only the object locked: since it was opened, another reaper may have removed it and a
    // new creator made the name again.
    struct stat named {};
    if (fstatat(dir_fd, name, &named, AT_SYMLINK_NOFOLLOW) != 0 || !SameInode(named, opened)) {
      continue;
    }
    // EPERM (another user's object in the sticky /dev/shm) and ENOENT are left quietly.
    if (unlinkat(dir_fd, name, 0) == 0) reaped.push_back(absl::StrCat("/", name));
  }
  return reaped;
}

absl::StatusOr<std::unique_ptr<EngineBuffers>> EngineBuffers::Create(
    const ModelLayout& model, const BufferShape& shape, const std::string& tag,
    std::chrono::seconds stale_grace) {
  RETURN_IF_ERROR(CheckGrace("stale_grace", stale_grace));
  absl::StatusOr<BufferPlan> plan = BufferPlan::For(model, shape);
  if (!plan.ok()) return plan.status();
  // Before creating: a crash-looping engine's dead objects would otherwise fill /dev/shm
  // until this Create could not fit its own. Best effort, and its grace is checked above:
  // nothing fails here.
  (void)ReapStaleShm(tag, stale_grace);
  static std::atomic<uint32_t> counter{0};  // at most 10 digits: NamedForTag's grammar
  auto b = std::unique_ptr<EngineBuffers>(new EngineBuffers(*std::move(plan)));
  const uint64_t size = b->plan_.size;
  // /eps-<tag>-<pid>-<n>, created exclusively. A name can be taken by an object a dead
  // process of the same pid left behind: a crashed engine restarted in its container, whose
  // /dev/shm outlives it, often gets its old pid back. The reaping above removed such an
  // object if it was old enough; one still there is left alone (it may not be stale) and a
  // random suffix makes another name.
  b->name_ = absl::StrCat("/eps-", tag, "-", getpid(), "-", counter.fetch_add(1));
  const std::string base = b->name_;
  int fd = shm_open(b->name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  for (int retry = 0; fd < 0 && errno == EEXIST && retry < 8; ++retry) {
    std::random_device entropy;
    b->name_ =
        absl::StrCat(base, "-", absl::Hex(uint64_t{entropy()} << 32 | entropy(), absl::kZeroPad16));
    fd = shm_open(b->name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  }
  if (fd < 0)
    return absl::InternalError(absl::StrCat("shm_open ", b->name_, ": ", std::strerror(errno)));
  // Held from now until the destructor: what tells ReapStaleShm that the object's creator
  // lives. Until this line the object is unheld, which kStaleShmGrace covers. It cannot be
  // held already but by a reaper (LOCK_EX) about to remove it: an error then, not an
  // object that is gone.
  if (flock(fd, LOCK_SH | LOCK_NB) != 0) {
    const int err = errno;
    shm_unlink(b->name_.c_str());
    close(fd);
    return absl::InternalError(absl::StrCat("flock(LOCK_SH) ", b->name_, ": ", std::strerror(err)));
  }
  // posix_fallocate, not ftruncate alone: on tmpfs a truncated object is sparse, so a
  // /dev/shm too small for it (a container's 64 MiB) would surface as SIGBUS at the first
  // write of a page it cannot hold, here or in the engine, instead of as an error now.
  if (const int err = posix_fallocate(fd, 0, static_cast<off_t>(size)); err != 0) {
    shm_unlink(b->name_.c_str());
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("posix_fallocate ", b->name_, " (", size, " bytes): ", std::strerror(err),
                     err == ENOSPC ? " (is /dev/shm large enough? `df -h /dev/shm`)" : ""));
  }
  void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) {
    const int err = errno;
    shm_unlink(b->name_.c_str());
    close(fd);
    return absl::InternalError(absl::StrCat("mmap ", b->name_, ": ", std::strerror(err)));
  }
  b->lock_fd_ = fd;
  b->creator_ = getpid();
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
    // Only in the creating process: a forked child's copy names its parent's object, which
    // may well be live (epsd opens it again by name at a re-attach).
    if (getpid() == creator_) shm_unlink(name_.c_str());
  }
  // After the unlink: unheld, the object could be taken for a dead process's. In a forked
  // child this closes the child's copy of the descriptor; the parent's keeps the lock.
  if (lock_fd_ >= 0) close(lock_fd_);
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
