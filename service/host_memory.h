// Host memory a CPU-backend session reads and writes: POSIX shared-memory
// objects the engine created (mapped here), or buffers that live inside the
// messages (owned here).
//
// Ownership: a HostMemory owns its mapping or allocation and releases it in its
// destructor. Thread safety: immutable after creation; the bytes themselves are
// shared with the engine and synchronised by the step protocol. A shm mapping
// is covered by ShmFaultGuard: an engine that shrinks its object cannot crash
// epsd, and faulted() then says the session's memory is gone.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace eps::service {

// Memory a session's tensors live in: host shm, an inline buffer, or a CUDA
// IPC mapping (service/cuda_backend.h). Owned by the session's MappingCache.
class MappedMemory {
 public:
  virtual ~MappedMemory() = default;
  virtual std::byte* data() const = 0;
  virtual uint64_t size() const = 0;
  virtual const std::string& name() const = 0;
  virtual bool is_inline() const { return false; }
  virtual bool is_device() const { return false; }
  // True once the engine shrank the object under epsd (its pages now read as zeros).
  virtual bool faulted() const { return false; }
};

// Whether `name` is one plain POSIX shm name: '/' then 1-254 bytes of printable
// ASCII, no '/', not "." or ".." (INVALID_ARGUMENT naming `field` otherwise).
absl::Status CheckShmName(const std::string& field, const std::string& name);

class HostMemory final : public MappedMemory {
 public:
  // Maps the shm object `name` (a regular file under /dev/shm, no symlink)
  // read-write. `declared_size` must equal its size. With `owner`, the object
  // must belong to that user (PERMISSION_DENIED otherwise, before it is mapped):
  // epsd opens it with its own rights, which must not stand in for the caller's.
  static absl::StatusOr<std::unique_ptr<HostMemory>> MapShm(
      const std::string& name, uint64_t declared_size, std::optional<uid_t> owner = std::nullopt);
  // Allocates `size` zeroed bytes, pages of their own that go back to the system with the
  // value, then copies `initial` (at most `size` bytes) in.
  static absl::StatusOr<std::unique_ptr<HostMemory>> Allocate(uint64_t size,
                                                              const std::string& initial);

  ~HostMemory();
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;

  std::byte* data() const override { return data_; }
  uint64_t size() const override { return size_; }
  bool is_inline() const override { return inline_; }
  const std::string& name() const override { return name_; }
  bool faulted() const override;

 private:
  HostMemory() = default;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  std::string name_;
  bool inline_ = false;    // an anonymous mapping of its own: munmap on destruction
  bool mapped_ = false;    // shm: munmap on destruction
  int guard_region_ = -1;  // shm: its ShmFaultGuard region
};

}  // namespace eps::service
