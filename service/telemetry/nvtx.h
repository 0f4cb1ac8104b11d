// NVTX ranges around GPU work, for Nsight Systems timelines. Built with CUDA
// (EPS_WITH_NVTX, set by service/telemetry/CMakeLists.txt when nvtx3's
// header-only API is found in the toolkit) a NvtxRange pushes a named range
// for its lifetime; otherwise it compiles to nothing.
//
//   { eps::telemetry::NvtxRange range("eps.prepass"); LaunchPrepass(...); }
//
// Thread safety: ranges are per thread, as NVTX's push/pop are.
#pragma once

#if defined(EPS_WITH_NVTX)
#include <nvtx3/nvToolsExt.h>
#endif

namespace eps::telemetry {

class NvtxRange {
 public:
#if defined(EPS_WITH_NVTX)
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
#else
  explicit NvtxRange(const char*) {}
#endif
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace eps::telemetry
