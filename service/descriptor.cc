#include "service/descriptor.h"

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "service/convert.h"

namespace eps::service {
namespace {

int ElementSize(v1::DType dtype) {
  const absl::StatusOr<DType> core = FromProto(dtype);
  return core.ok() ? DTypeSize(*core) : 0;
}

}  // namespace

absl::StatusOr<const MappedMemory*> MappingCache::Resolve(const v1::MemoryDescriptor& desc,
                                                          const std::string& name,
                                                          uint64_t needed_bytes) {
  switch (desc.memory_case()) {
    case v1::MemoryDescriptor::kHostShm: {
      const std::string& shm_name = desc.host_shm().name();
      auto it = shm_.find(shm_name);
      if (it != shm_.end()) {
        if (it->second->size() != desc.host_shm().size()) {
          return absl::InvalidArgumentError(
              absl::StrCat(name, ".host_shm.size=", desc.host_shm().size(), " differs from ",
                           it->second->size(), " declared for ", shm_name, " by another buffer"));
        }
        return it->second.get();
      }
      if (mapped_budget_ != nullptr) {
        absl::StatusOr<MemoryCharge> charge = mapped_budget_->Charge(
            desc.host_shm().size(), absl::StrCat(name, "'s host_shm ", shm_name, " mapping"));
        if (!charge.ok()) return charge.status();
        charges_.push_back(*std::move(charge));
      }
      absl::StatusOr<std::unique_ptr<HostMemory>> memory =
          HostMemory::MapShm(shm_name, desc.host_shm().size(), shm_owner_);
      if (!memory.ok()) {
        return absl::Status(memory.status().code(),
                            absl::StrCat(name, ": ", memory.status().message()));
      }
      const MappedMemory* raw = memory->get();
      shm_.emplace(shm_name, std::move(*memory));
      return raw;
    }
    case v1::MemoryDescriptor::kInlineBytes: {
      if (budget_ != nullptr) {
        absl::StatusOr<MemoryCharge> charge =
            budget_->Charge(needed_bytes, absl::StrCat(name, " inline buffer"));
        if (!charge.ok()) return charge.status();
        charges_.push_back(*std::move(charge));
      }
      absl::StatusOr<std::unique_ptr<HostMemory>> memory =
          HostMemory::Allocate(needed_bytes, desc.inline_bytes().data());
      if (!memory.ok()) {
        return absl::Status(memory.status().code(),
                            absl::StrCat(name, ": ", memory.status().message()));
      }
      inline_.push_back(std::move(*memory));
      return inline_.back().get();
    }
    case v1::MemoryDescriptor::kCudaIpc: {
      if (!open_ipc_) break;  // cpu backend: refused below
      const std::string key =
          desc.cuda_ipc().handle() + "@" + std::to_string(desc.cuda_ipc().device());
      auto it = ipc_.find(key);
      if (it != ipc_.end()) return it->second.get();
      std::unique_ptr<MappedMemory> unusable;
      absl::StatusOr<std::unique_ptr<MappedMemory>> memory = open_ipc_(desc.cuda_ipc(), &unusable);
      if (unusable != nullptr) unusable_.push_back(std::move(unusable));
      if (!memory.ok()) {
        return absl::Status(memory.status().code(),
                            absl::StrCat(name, ": ", memory.status().message()));
      }
      const MappedMemory* raw = memory->get();
      ipc_.emplace(key, std::move(*memory));
      return raw;
    }
    case v1::MemoryDescriptor::kCudaVmm:
      return absl::UnimplementedError(
          absl::StrCat(name,
                       " is a CUDA VMM file descriptor, which this server does not accept yet; "
                       "allocate with cudaMalloc and send a cuda_ipc handle"));
    case v1::MemoryDescriptor::MEMORY_NOT_SET:
      return absl::InvalidArgumentError(absl::StrCat(name, ".memory is not set"));
  }
  if (desc.memory_case() == v1::MemoryDescriptor::kCudaIpc) {
    return absl::FailedPreconditionError(
        absl::StrCat(name,
                     " is CUDA device memory, which the cpu backend cannot read; attach with "
                     "host_shm or inline_bytes, or attach with backend=BACKEND_CUDA"));
  }
  return absl::InvalidArgumentError(absl::StrCat(name, ".memory is not set"));
}

absl::Status MappingCache::CheckIntact() const {
  for (const auto& [name, memory] : shm_) {
    if (memory->faulted()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "host_shm ", name, " shrank below its attached size of ", memory->size(),
          " bytes while attached; epsd no longer reads it: re-attach with whole buffers"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<MappedTensor> ResolveTensor(const v1::MemoryDescriptor& desc, const TensorSpec& spec,
                                           MappingCache& cache) {
  const std::string& name = spec.name;
  if (desc.dtype() != spec.dtype) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".dtype=", ProtoDTypeName(desc.dtype()),
                                                   ", want ", ProtoDTypeName(spec.dtype)));
  }
  if (desc.shape_size() != static_cast<int>(spec.shape.size())) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has rank ", desc.shape_size(), ", want ",
                                                   spec.shape.size(), " [",
                                                   absl::StrJoin(spec.dim_names, ", "), "]"));
  }
  MappedTensor t;
  int64_t elements = 1;
  for (int i = 0; i < desc.shape_size(); ++i) {
    const int64_t dim = desc.shape(i);
    if (dim < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".shape[", i, "]=", dim, " must be >= 1"));
    }
    if (spec.shape[i] >= 0 && dim != spec.shape[i]) {
      return absl::InvalidArgumentError(absl::StrCat(name, ".shape[", i, "]=", dim,
                                                     " does not match ", spec.dim_names[i], "=",
                                                     spec.shape[i]));
    }
    if (__builtin_mul_overflow(elements, dim, &elements)) {
      return absl::InvalidArgumentError(absl::StrCat(name, ".shape overflows int64"));
    }
    t.shape.push_back(dim);
  }
  if (desc.strides_size() != 0) {
    if (desc.strides_size() != desc.shape_size()) {
      return absl::InvalidArgumentError(absl::StrCat(name, " has ", desc.strides_size(),
                                                     " strides for rank ", desc.shape_size()));
    }
    int64_t expected = 1;
    for (int i = desc.shape_size() - 1; i >= 0; --i) {
      if (desc.strides(i) != expected) {
        return absl::InvalidArgumentError(absl::StrCat(name, ".strides[", i, "]=", desc.strides(i),
                                                       ", want ", expected,
                                                       ": v1 accepts contiguous row-major only"));
      }
      expected *= desc.shape(i);
    }
  }
  const int element = ElementSize(spec.dtype);
  int64_t bytes = 0;
  if (__builtin_mul_overflow(elements, int64_t{element}, &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(name, " size overflows int64"));
  }
  if (desc.offset() % element != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ".offset=", desc.offset(), " is not aligned to its ", element, "-byte elements"));
  }
  uint64_t end = 0;
  if (__builtin_add_overflow(desc.offset(), static_cast<uint64_t>(bytes), &end)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".offset + size overflows"));
  }
  if (spec.alignment > 0 && desc.offset() % spec.alignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".offset=", desc.offset(), " is not a multiple of ", spec.alignment,
                     " bytes (its records are read ", spec.alignment, " bytes at a time)"));
  }
  absl::StatusOr<const MappedMemory*> memory = cache.Resolve(desc, name, end);
  if (!memory.ok()) return memory.status();
  if (end > (*memory)->size()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": offset ", desc.offset(), " + ", bytes,
                                                   " bytes exceeds the ", (*memory)->size(),
                                                   "-byte allocation ", (*memory)->name()));
  }
  t.data = (*memory)->data() + desc.offset();
  t.bytes = static_cast<uint64_t>(bytes);
  t.memory = *memory;
  t.offset = desc.offset();
  t.is_inline = (*memory)->is_inline();
  t.is_device = (*memory)->is_device();
  return t;
}

absl::Status CheckNoOverlap(const std::vector<std::pair<TensorSpec, MappedTensor>>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].first.writable) continue;
    const MappedTensor& a = tensors[i].second;
    for (size_t j = 0; j < tensors.size(); ++j) {
      const MappedTensor& b = tensors[j].second;
      if (i == j || a.is_inline != b.is_inline || a.is_device != b.is_device) continue;
      // By address, not by mapping: one CUDA IPC allocation named by two descriptors that
      // differ only in `cuda_ipc.device` (unchecked with device_uuid) is opened twice, and
      // CUDA hands back the same pointer to two mappings.
      const auto a_at = reinterpret_cast<uintptr_t>(a.data);
      const auto b_at = reinterpret_cast<uintptr_t>(b.data);
      if (a_at < b_at + b.bytes && b_at < a_at + a.bytes) {
        return absl::InvalidArgumentError(
            absl::StrCat(tensors[i].first.name, " overlaps ", tensors[j].first.name, " in ",
                         a.memory != nullptr ? a.memory->name() : std::string("the same memory")));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace eps::service
