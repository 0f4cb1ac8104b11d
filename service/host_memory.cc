#include "service/host_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace eps::service {
namespace {

constexpr uint64_t kMaxInlineBytes = uint64_t{1} << 30;

absl::Status Errno(const std::string& what, int err) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  return absl::InternalError(message);
}

}  // namespace

absl::StatusOr<std::unique_ptr<HostMemory>> HostMemory::MapShm(const std::string& name,
                                                               uint64_t declared_size) {
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos ||
      name.size() > 255) {
    return absl::InvalidArgumentError(
        absl::StrCat("host_shm.name='", name, "' must be '/' followed by 1-254 chars, no '/'"));
  }
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return Errno(absl::StrCat("shm_open(", name, ")"), errno);
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return Errno(absl::StrCat("fstat(", name, ")"), err);
  }
  const uint64_t actual = static_cast<uint64_t>(st.st_size);
  if (actual != declared_size || actual == 0) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat("host_shm ", name, ": declared size ",
                                                   declared_size, " but the object holds ",
                                                   actual, " bytes"));
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
  return memory;
}

absl::StatusOr<std::unique_ptr<HostMemory>> HostMemory::Allocate(uint64_t size,
                                                                 const std::string& initial) {
  if (size == 0 || size > kMaxInlineBytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("inline buffer of ", size, " bytes not in [1, ", kMaxInlineBytes, "]"));
  }
  if (initial.size() > size) {
    return absl::InvalidArgumentError(absl::StrCat("inline data of ", initial.size(),
                                                   " bytes exceeds the buffer's ", size));
  }
  auto memory = std::unique_ptr<HostMemory>(new HostMemory());
  memory->owned_ = std::make_unique<std::byte[]>(size);  // value-initialised: zeros
  std::memcpy(memory->owned_.get(), initial.data(), initial.size());
  memory->data_ = memory->owned_.get();
  memory->size_ = size;
  memory->name_ = "<inline>";
  return memory;
}

HostMemory::~HostMemory() {
  if (mapped_) munmap(data_, size_);
}

}  // namespace eps::service
