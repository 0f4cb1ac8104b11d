// Built instead of device_buffer_set.cc when nvcc is absent.
#include "load/buffer_set.h"

namespace eps::load {

int DeviceCount() { return 0; }

absl::StatusOr<std::unique_ptr<BufferSet>> CreateDeviceBufferSet(const ModelLayout&,
                                                                 const BufferSetShape&, int) {
  return absl::FailedPreconditionError("--backend=cuda: this eps-load was built without CUDA");
}

}  // namespace eps::load
