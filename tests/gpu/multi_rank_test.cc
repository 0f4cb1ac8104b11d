// One epsd serving the tensor-parallel ranks of an engine: this test starts a
// real `epsd --backend=cuda` and one rank_engine process per rank (the vLLM
// shape: a process per GPU), each attaching its rank's share of the KV heads as
// its own session and stepping in lockstep; each rank checks every step's lists
// against core/ (rank_engine.cc). Runs several ranks on one GPU (every ordinal
// 0) and, where the host has two or more GPUs, rank r on GPU r.
//
// EPS_TEST_RANKS (default 4, a divisor of 8) and EPS_TEST_RANK_STEPS (default
// 1000) set the size; EPS_TEST_SEED replays the data; EPSD_BIN and
// RANK_ENGINE_BIN replace the build's binaries (scripts/gpu_check.sh).
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "client/cpp/eps_client.h"
#include "gpu/device.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/gpu/rank_board.h"
#include "tests/service/epsd_process.h"

namespace eps {
namespace {

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && std::atoi(v) > 0 ? std::atoi(v) : fallback;
}

// How rank r finds its GPU.
struct RankDevice {
  int ordinal = 0;              // the rank process's own ordinal of its GPU
  bool uuid = false;            // attach with its device_uuid
  std::string visible_devices;  // CUDA_VISIBLE_DEVICES for the rank; empty: inherited
};

// Starts the ranks, waits for all, and prints the spread of their replies.
void RunRanks(const std::vector<RankDevice>& devices, int steps, const std::string& tag) {
  const int ranks = static_cast<int>(devices.size());
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket(tag), {"--backend=cuda"});
  ASSERT_NE(epsd, nullptr);
  const std::string board_name = "/eps-ranks-" + std::to_string(getpid()) + "-" + tag;
  shm_unlink(board_name.c_str());
  testing::RankBoard* board = testing::MapRankBoard(board_name, ranks, steps, /*create=*/true);
  ASSERT_NE(board, nullptr) << "shm " << board_name;
  const char* binary =
      std::getenv("RANK_ENGINE_BIN") != nullptr ? std::getenv("RANK_ENGINE_BIN") : RANK_ENGINE_PATH;
  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    std::vector<std::string> args = {binary,
                                     "--target=" + epsd->target(),
                                     "--board=" + board_name,
                                     "--rank=" + std::to_string(r),
                                     "--ranks=" + std::to_string(ranks),
                                     "--steps=" + std::to_string(steps),
                                     "--seed=" + std::to_string(seed),
                                     "--device=" + std::to_string(devices[r].ordinal),
                                     std::string("--uuid=") + (devices[r].uuid ? "1" : "0")};
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      if (devices[r].visible_devices.empty() ||
          std::string(*e).rfind("CUDA_VISIBLE_DEVICES=", 0) != 0) {
        env.emplace_back(*e);
      }
    }
    if (!devices[r].visible_devices.empty()) {
      env.push_back("CUDA_VISIBLE_DEVICES=" + devices[r].visible_devices);
    }
    std::vector<char*> argv, envp;
    for (std::string& a : args) argv.push_back(a.data());
    for (std::string& e : env) envp.push_back(e.data());
    argv.push_back(nullptr);
    envp.push_back(nullptr);
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, binary, nullptr, nullptr, argv.data(), envp.data()), 0) << binary;
    pids.push_back(pid);
  }
  int failures = 0;
  for (size_t i = 0; i < pids.size(); ++i) {
    int status = 0;
    ASSERT_EQ(waitpid(pids[i], &status, 0), pids[i]);
    const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok) board->failed.store(1);  // the others stop waiting for it
    failures += !ok;
    EXPECT_TRUE(ok) << "rank " << i << " exited with status " << status;
  }
  if (failures == 0) {
    // The engine's step waits for its slowest rank: the spread of the reply times.
    std::vector<double> spread;
    for (int s = 0; s < steps; ++s) {
      double lo = 1e300, hi = -1e300;
      for (int r = 0; r < ranks; ++r) {
        const double t = board->reply_us()[static_cast<size_t>(r) * steps + s];
        lo = std::min(lo, t);
        hi = std::max(hi, t);
      }
      spread.push_back(hi - lo);
    }
    std::printf(
        "%s: %d ranks x %d steps in lockstep; spread between ranks' replies at the same "
        "step p50 %.1f us p99 %.1f us max %.1f us\n",
        tag.c_str(), ranks, steps, testing::Percentile(spread, 0.5),
        testing::Percentile(spread, 0.99), *std::max_element(spread.begin(), spread.end()));
  } else {
    std::printf("epsd log:\n%s\n", epsd->Log().c_str());
  }
  testing::UnmapRankBoard(board);
  shm_unlink(board_name.c_str());
}

TEST(MultiRankTest, RanksOnOneGpuStepInLockstepAndMatchTheCoreReference) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const int ranks = EnvInt("EPS_TEST_RANKS", 4);
  ASSERT_EQ(8 % ranks, 0) << "EPS_TEST_RANKS=" << ranks << " must divide the 8 KV heads";
  std::vector<RankDevice> devices(ranks);
  // Every rank on ordinal 0; half of them name it by UUID, half by ordinal.
  for (int r = 0; r < ranks; ++r) devices[r].uuid = r % 2 == 0;
  RunRanks(devices, EnvInt("EPS_TEST_RANK_STEPS", 1000), "one-gpu");
}

TEST(MultiRankTest, RanksOnTheirOwnGpusStepInLockstepAndMatchTheCoreReference) {
  const int count = gpu::DeviceCount();
  if (count < 2) GTEST_SKIP() << count << " CUDA device(s): needs 2 or more";
  int ranks = 8;
  while (ranks > count) ranks /= 2;
  ranks = std::min(ranks, EnvInt("EPS_TEST_RANKS", ranks));
  ASSERT_EQ(8 % ranks, 0) << "EPS_TEST_RANKS=" << ranks << " must divide the 8 KV heads";
  std::vector<std::string> visible;
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES"); v != nullptr && *v != '\0') {
    visible = absl::StrSplit(v, ',');
  }
  std::vector<RankDevice> devices(ranks);
  for (int r = 0; r < ranks; ++r) {
    if (r % 2 == 0) {
      // As vLLM starts a rank: it sees only its GPU (ordinal 0) and names it by UUID.
      devices[r].visible_devices =
          r < static_cast<int>(visible.size()) ? visible[r] : std::to_string(r);
      devices[r].ordinal = 0;
      devices[r].uuid = true;
    } else {
      devices[r].ordinal = r;  // sees every GPU, numbered as epsd numbers them
    }
  }
  RunRanks(devices, EnvInt("EPS_TEST_RANK_STEPS", 1000), "own-gpus");
}

v1::AttachRequest AttachOnDevice(int device) {
  v1::AttachRequest a;
  a.set_engine_id("missing-device");
  v1::ModelLayout* l = a.mutable_layout();
  l->set_num_layers(1);
  l->set_num_q_heads(8);
  l->set_num_kv_heads(2);
  l->set_head_dim(128);
  l->set_block_size(16);
  a.set_max_batch(1);
  a.set_backend(v1::BACKEND_CUDA);
  a.set_device(device);
  // Never mapped: the device is checked before any descriptor.
  a.mutable_buffers()->mutable_summary_pool()->mutable_cuda_ipc()->set_handle(
      std::string(64, '\0'));
  a.mutable_buffers()->mutable_summary_pool()->mutable_cuda_ipc()->set_device(device);
  return a;
}

absl::Status AttachStatus(const std::string& target, const v1::AttachRequest& request) {
  client::ClientOptions options;
  options.target = target;
  options.attach_deadline = std::chrono::seconds(30);
  client::EpsClient client(options, request);
  return client.Attach();
}

TEST(MultiRankTest, AttachNamingAMissingDeviceIsInvalidArgument) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket("nodev"), {"--backend=cuda"});
  ASSERT_NE(epsd, nullptr);
  const int count = gpu::DeviceCount();
  absl::Status s = AttachStatus(epsd->target(), AttachOnDevice(count));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("device=" + std::to_string(count)), std::string::npos) << s;

  v1::AttachRequest unknown = AttachOnDevice(0);
  unknown.set_device_uuid(std::string(16, '\x5a'));
  s = AttachStatus(epsd->target(), unknown);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("device_uuid=GPU-5a5a5a5a"), std::string::npos) << s;

  v1::AttachRequest split = AttachOnDevice(0);
  split.mutable_buffers()->mutable_queries()->mutable_cuda_ipc()->set_device(1);
  s = AttachStatus(epsd->target(), split);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("buffers.queries.cuda_ipc.device=1"), std::string::npos) << s;
}

}  // namespace
}  // namespace eps
