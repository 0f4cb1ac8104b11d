// The board that the rank processes of multi_rank_test share (a POSIX shm
// object the test creates): a step barrier and each rank's reply times.
//
// The barrier is a counter: rank processes add one before each step and wait
// until all ranks arrived, by spinning with yields (a futex in libstdc++'s
// std::atomic::wait is private to a process). A failing rank raises `failed`,
// so the others stop waiting instead of hanging; every wait is bounded too.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

namespace eps::testing {

struct RankBoard {
  std::atomic<uint64_t> arrived{0};
  std::atomic<uint32_t> failed{0};
  int32_t ranks = 0;
  int32_t steps = 0;
  // Followed by double reply_us[ranks][steps]: steady_clock (CLOCK_MONOTONIC,
  // one clock for every process of the host) when rank r's step s+1 replied.
  double* reply_us() { return reinterpret_cast<double*>(this + 1); }
  static size_t Bytes(int ranks, int steps) {
    return sizeof(RankBoard) + sizeof(double) * static_cast<size_t>(ranks) * steps;
  }

  // Waits until every rank arrived at `step` (1-based); false when a rank
  // failed or `timeout` passed.
  bool ArriveAndWait(int step, std::chrono::seconds timeout) {
    arrived.fetch_add(1, std::memory_order_acq_rel);
    const uint64_t want = static_cast<uint64_t>(ranks) * step;
    const auto give_up = std::chrono::steady_clock::now() + timeout;
    for (int spin = 0; arrived.load(std::memory_order_acquire) < want; ++spin) {
      if (failed.load(std::memory_order_relaxed) != 0) return false;
      if ((spin & 1023) == 1023 && std::chrono::steady_clock::now() > give_up) return false;
      std::this_thread::yield();
    }
    return failed.load(std::memory_order_relaxed) == 0;
  }
};

inline double SteadyMicros() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Maps the board `name` (created with `create`: sized and zeroed); null on failure.
inline RankBoard* MapRankBoard(const std::string& name, int ranks, int steps, bool create) {
  const int fd = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0) return nullptr;
  const size_t bytes = RankBoard::Bytes(ranks, steps);
  if (create && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    return nullptr;
  }
  void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (at == MAP_FAILED) return nullptr;
  auto* board = static_cast<RankBoard*>(at);
  if (create) {
    new (board) RankBoard();
    board->ranks = ranks;
    board->steps = steps;
  }
  return board;
}

inline void UnmapRankBoard(RankBoard* board) {
  if (board != nullptr) munmap(board, RankBoard::Bytes(board->ranks, board->steps));
}

}  // namespace eps::testing
