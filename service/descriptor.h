// Validation of the memory descriptors a session attaches with, and their
// resolution to host tensors (CPU backend).
//
// Every check happens here, before any byte is touched: the memory kind, the
// dtype, the rank and every dimension against the layout, contiguity, integer
// overflow of the extent, alignment, the extent against the allocation, and
// overlap between outputs and everything else.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "eps/v1/page_selector.pb.h"
#include "service/host_memory.h"
#include "service/memory_budget.h"

namespace eps::service {

// What a buffer must look like: a dimension of -1 is free (any value ≥ 1).
struct TensorSpec {
  std::string name;  // "summary_pool", ... (used in messages)
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  std::vector<int64_t> shape;
  std::vector<std::string> dim_names;  // what each fixed dimension must equal, for messages
  bool writable = false;               // an output of the sidecar
  int alignment = 0;  // bytes the offset must be a multiple of; 0: the element size
};

// A validated tensor in mapped memory: host shm, an inline buffer, or a CUDA
// IPC mapping of device memory. Borrowed pointer: the memory is owned by the
// session's MappingCache.
struct MappedTensor {
  std::byte* data = nullptr;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  const MappedMemory* memory = nullptr;
  uint64_t offset = 0;
  bool is_inline = false;
  bool is_device = false;
};

// Opens a CUDA IPC handle for a CUDA-backend session. A mapping it opened but cannot
// use goes to `unusable` with the error, to be closed with the session's other
// mappings (by its janitor), not on the Attach's thread.
using CudaIpcOpener = std::function<absl::StatusOr<std::unique_ptr<MappedMemory>>(
    const v1::CudaIpcHandle&, std::unique_ptr<MappedMemory>* unusable)>;

// One mapping per shm name or IPC handle per session; inline buffers one per
// descriptor. Without an IPC opener (the cpu backend), device memory is refused.
class MappingCache {
 public:
  void set_cuda_ipc_opener(CudaIpcOpener opener) { open_ipc_ = std::move(opener); }
  // Inline buffers are charged to `budget` before they are allocated (null: not
  // charged). The budget must outlive the cache.
  void set_budget(MemoryBudget* budget) { budget_ = budget; }
  // Each host_shm object's size is charged to `mapped` before it is mapped (null: not
  // charged). The budget must outlive the cache.
  void set_mapped_budget(MemoryBudget* mapped) { mapped_budget_ = mapped; }
  // The user every host_shm object must belong to (nullopt: any; docs/security.md,
  // ShmOwnerFor).
  void set_shm_owner(std::optional<uid_t> owner) { shm_owner_ = owner; }
  absl::StatusOr<const MappedMemory*> Resolve(const v1::MemoryDescriptor& desc,
                                              const std::string& name, uint64_t needed_bytes);
  // Every mapping held, the unusable ones included.
  size_t size() const { return shm_.size() + inline_.size() + ipc_.size() + unusable_.size(); }
  // FAILED_PRECONDITION naming the first shm object that the engine shrank
  // under epsd (ShmFaultGuard); OK while every mapping is whole.
  absl::Status CheckIntact() const;

 private:
  MemoryBudget* budget_ = nullptr;
  MemoryBudget* mapped_budget_ = nullptr;
  std::optional<uid_t> shm_owner_;
  std::vector<MemoryCharge> charges_;  // released after the buffers they paid for
  std::map<std::string, std::unique_ptr<MappedMemory>> shm_;
  std::vector<std::unique_ptr<MappedMemory>> inline_;
  std::map<std::string, std::unique_ptr<MappedMemory>> ipc_;
  std::vector<std::unique_ptr<MappedMemory>> unusable_;  // opened, failed (CudaIpcOpener)
  CudaIpcOpener open_ipc_;
};

absl::StatusOr<MappedTensor> ResolveTensor(const v1::MemoryDescriptor& desc, const TensorSpec& spec,
                                           MappingCache& cache);

// Rejects any writable tensor that overlaps another tensor of the same memory.
absl::Status CheckNoOverlap(const std::vector<std::pair<TensorSpec, MappedTensor>>& tensors);

}  // namespace eps::service
