// The JSONL step log (--step-log=PATH): one JSON object per line, appended by
// RPC threads into a buffer that a writer thread flushes every 200 ms, so a
// step never waits on the disk. If the disk falls 8 MiB behind, lines are
// dropped and counted (eps_step_log_lines_dropped_total) rather than stalling.
//
// Thread safety: Append and dropped() may be called from any thread.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace eps::telemetry {

class StepLog {
 public:
  // How a buffer reaches the file: write(2) but for tests.
  using WriteFn = std::function<ssize_t(int fd, const void* data, size_t size)>;
  // Opens `path` for appending (created 0644 if absent); a path that is not a regular
  // file (a FIFO, a device, a directory) is FAILED_PRECONDITION, never waited on.
  static absl::StatusOr<std::unique_ptr<StepLog>> Open(const std::string& path,
                                                       WriteFn write = nullptr);
  ~StepLog();  // writes what is buffered, then closes
  StepLog(const StepLog&) = delete;
  StepLog& operator=(const StepLog&) = delete;

  // `line`: one JSON object without the newline.
  void Append(const std::string& line);
  uint64_t dropped() const;
  const std::string& path() const { return path_; }

 private:
  StepLog(int fd, std::string path, WriteFn write);
  void Run();
  void Write(const std::string& bytes);

  const int fd_;
  const std::string path_;
  mutable absl::Mutex mu_;
  std::string pending_ ABSL_GUARDED_BY(mu_);
  uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  const WriteFn write_;
  bool write_failed_ = false;  // writer thread only
  bool mid_line_ = false;      // writer thread only: the file ends inside a line
  std::thread writer_;
};

}  // namespace eps::telemetry
