// A CUDA IPC memory handle opened in this process (docs/design.md §5): the engine's
// client library allocates with cudaMalloc and sends the 64-byte legacy handle.
//
// Ownership: the mapping is closed (cudaIpcCloseMemHandle) in the destructor,
// unless a stream abandoned on its device may still touch it (live_streams.h
// NoteAbandonedStream): then it stays mapped for the life of the process.
// The allocation's size comes from the driver (cuMemGetAddressRange), so every
// descriptor's extent is checked against the real allocation. An allocation of another
// GPU than `device` is mapped across the peer link, and cannot be told apart (ipc_mapping.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace eps::gpu {

class IpcMapping {
 public:
  // A `device` this process does not have, or one it cannot make current (SetDevice,
  // gpu/cuda_check.h), is FAILED_PRECONDITION naming it.
  // `unusable`: where a mapping that this call opened but cannot use (its
  // allocation's range unknown) goes with the error, so that its caller
  // closes it where a close cannot wait behind another engine's queued step (a session's janitor:
  // closing a mapping waits for the device as a free does); null: closed here.
  static absl::StatusOr<std::unique_ptr<IpcMapping>> Open(
      const std::string& handle, int device, std::unique_ptr<IpcMapping>* unusable = nullptr);
  ~IpcMapping();
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  int device() const { return device_; }

 private:
  IpcMapping() = default;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  int device_ = 0;
};

// Reads the uint64 at device address `at` (a step counter of the flags buffer) on `device`:
// FAILED_PRECONDITION naming the ordinal when it cannot be made current (SetDevice).
absl::StatusOr<uint64_t> ReadCounter(int device, const uint64_t* at);

}  // namespace eps::gpu
