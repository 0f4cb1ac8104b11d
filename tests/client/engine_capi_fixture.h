// The fixture of libeps_engine's C ABI tests (engine_capi_test.cc, engine_capi_thread_test.cc):
// a model of every summary part, device memory freed with the test. Skips without a device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "client/cpp/engine_capi.h"
#include "core/layout.h"
#include "core/summary.h"
#include "gpu/device.h"
#include "gtest/gtest.h"
#include "tests/client/device_memory.h"

namespace eps::capi_testing {

inline uint64_t Addr(const void* p) { return reinterpret_cast<uint64_t>(p); }

// INVALID_ARGUMENT with a message that says `says`.
inline void ExpectRefused(int rc, const std::string& says) {
  EXPECT_EQ(rc, 3) << says;  // INVALID_ARGUMENT
  EXPECT_NE(std::string(eps_engine_last_error()).find(says), std::string::npos)
      << eps_engine_last_error();
}

class EngineCapiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!eps::gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
    model_ = {2, 4, 2, 64, 16, 8, 8, 0x5EEDULL, 1, 0, 1, 1};  // key_sum, quest and quest8
  }
  template <typename T>
  T* Alloc(size_t n) {
    return memory_.Alloc<T>(n);
  }
  eps::ModelLayout Layout() const {
    eps::ModelLayout m;
    m.num_layers = model_.num_layers;
    m.num_q_heads = model_.num_q_heads;
    m.num_kv_heads = model_.num_kv_heads;
    m.head_dim = model_.head_dim;
    m.sketch_dim = model_.sketch_dim;
    m.phi_seed = model_.phi_seed;
    m.features = {.key_sum = true, .principal = false, .quest = true, .quest8 = true};
    return m;
  }
  int RecordWords() const { return eps::SummaryLayout::For(Layout()).record_words; }
  // selection_done (flags[1]), read back from the device.
  static uint64_t SelectionDone(const uint64_t* flags) {
    uint64_t done = 0;
    EXPECT_EQ(cudaMemcpy(&done, flags + 1, 8, cudaMemcpyDeviceToHost), cudaSuccess);
    return done;
  }
  // A dense release of `step`: selection_done reached it and every count is -1.
  static void ExpectReleasedDensely(const int32_t* counts, int64_t n, const uint64_t* flags,
                                    uint64_t step) {
    std::vector<int32_t> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), counts, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(SelectionDone(flags), step);
    for (int32_t c : host) EXPECT_EQ(c, -1);
  }
  EpsEngineModel model_{};
  eps::testing::DeviceMemory memory_;
};

}  // namespace eps::capi_testing
