#include "service/host_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "service/shm_fault_guard.h"

namespace eps::service {
namespace {

constexpr uint64_t kMaxInlineBytes = uint64_t{1} << 30;

absl::Status Errno(const std::string& what, int err) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  // The name passed CheckShmName; what is left of these is still the request's fault.
  if (err == EINVAL || err == ENAMETOOLONG || err == ELOOP || err == ENOTDIR || err == EISDIR) {
    return absl::InvalidArgumentError(message);
  }
  // Not the request's fault nor a bug: epsd is out of a resource (idle connections
  // hold descriptors, docs/deploy-operations.md), and the engine may retry once some are free.
  if (err == EMFILE || err == ENFILE) {
    return absl::ResourceExhaustedError(absl::StrCat(
        message,
        err == EMFILE ? ": epsd has used its open-file limit (RLIMIT_NOFILE)"
                      : ": the system's open-file table is full",
        "; close idle connections to epsd or raise the limit (docs/deploy-operations.md)"));
  }
  if (err == ENOMEM) {
    return absl::ResourceExhaustedError(
        absl::StrCat(message, ": epsd is out of memory or of mappings (vm.max_map_count)"));
  }
  return absl::InternalError(message);
}

}  // namespace

absl::Status CheckShmName(const std::string& field, const std::string& name) {
  // The name as the message shows it: NUL and other control bytes escaped, and at most
  // 128 bytes of it (a refused name can be as long as the request).
  auto shown = [&] {
    constexpr size_t kShown = 128;
    return name.size() <= kShown
               ? absl::StrCat(field, "='", absl::CHexEscape(name), "'")
               : absl::StrCat(field, "='", absl::CHexEscape(name.substr(0, kShown)), "...' (",
                              name.size(), " bytes)");
  };
  if (name.size() < 2 || name.size() > 255 || name[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat(shown(), " must be '/' followed by 1-254 bytes"));
  }
  for (size_t i = 1; i < name.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (c == '/' || c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: byte %d (0x%02x) is not allowed: a shm name is one plain name of printable "
          "ASCII without '/'",
          shown(), i, c));
    }
  }
  if (name == "/." || name == "/..") {
    return absl::InvalidArgumentError(absl::StrCat(shown(), " is a directory, not a shm name"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<HostMemory>> HostMemory::MapShm(const std::string& name,
                                                               uint64_t declared_size,
                                                               std::optional<uid_t> owner) {
  if (absl::Status s = CheckShmName("host_shm.name", name); !s.ok()) return s;
  // O_NONBLOCK: a FIFO planted under /dev/shm must not block the open.
  const int fd = shm_open(name.c_str(), O_RDWR | O_NONBLOCK, 0);
  if (fd < 0) return Errno(absl::StrCat("shm_open(", name, ")"), errno);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return Errno(absl::StrCat("fstat(", name, ")"), err);
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("host_shm ", name, " is not a regular shared-memory object"));
  }
  if (owner.has_value() && st.st_uid != *owner) {
    close(fd);
    return absl::PermissionDeniedError(
        absl::StrCat("host_shm ", name, " belongs to uid ", st.st_uid, ", not to uid ", *owner));
  }
  const uint64_t actual = static_cast<uint64_t>(st.st_size);
  if (actual != declared_size || actual == 0) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("host_shm ", name, ": declared size ",
                                                   declared_size, " but the object holds ", actual,
                                                   " bytes"));
  }
  void* addr = mmap(nullptr, actual, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);  // the mapping keeps the object alive
  if (addr == MAP_FAILED) return Errno(absl::StrCat("mmap(", name, ")"), err);
  auto memory = std::unique_ptr<HostMemory>(new HostMemory());
  memory->data_ = static_cast<std::byte*>(addr);
  memory->size_ = actual;
  memory->name_ = name;
  memory->mapped_ = true;
  // Covered before epsd touches a byte: the engine may shrink the object at any time.
  absl::StatusOr<int> region = ShmFaultGuard::Register(addr, actual);
  if (!region.ok()) return region.status();  // the destructor unmaps
  memory->guard_region_ = *region;
  return memory;
}

absl::StatusOr<std::unique_ptr<HostMemory>> HostMemory::Allocate(uint64_t size,
                                                                 const std::string& initial) {
  if (size == 0 || size > kMaxInlineBytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("inline buffer of ", size, " bytes not in [1, ", kMaxInlineBytes, "]"));
  }
  if (initial.size() > size) {
    return absl::InvalidArgumentError(
        absl::StrCat("inline data of ", initial.size(), " bytes exceeds the buffer's ", size));
  }
  // Pages of its own rather than the heap's: munmap gives them back to the system when the
  // session ends. From operator new, a buffer freed below glibc's dynamic mmap threshold
  // (which rises to the size of each large block freed, up to 32 MiB) stayed in its thread's
  // arena, so sessions that had ended kept epsd's resident memory up, beyond what the budgets
  // charge (14 MiB per arena after one Attach and Detach of a 14 MiB inline buffer). The
  // kernel's pages read as zeros until written, so nothing is cleared here.
  void* addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (addr == MAP_FAILED) return Errno("mmap(inline buffer)", errno);
  auto memory = std::unique_ptr<HostMemory>(new HostMemory());
  memory->data_ = static_cast<std::byte*>(addr);
  memory->size_ = size;
  memory->name_ = "<inline>";
  memory->inline_ = true;
  std::memcpy(memory->data_, initial.data(), initial.size());
  return memory;
}

bool HostMemory::faulted() const { return ShmFaultGuard::Faulted(guard_region_); }

HostMemory::~HostMemory() {
  ShmFaultGuard::Unregister(guard_region_);
  if (mapped_ || inline_) munmap(data_, size_);
}

}  // namespace eps::service
