// Resource use of another process (epsd) read from /proc, for soak runs.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace eps::load {

struct ProcessStats {
  int64_t rss_kb = 0;    // VmRSS of /proc/<pid>/status
  int64_t open_fds = 0;  // entries of /proc/<pid>/fd
  int64_t threads = 0;   // Threads of /proc/<pid>/status
};

absl::StatusOr<ProcessStats> ReadProcessStats(pid_t pid);

// The process that holds the listening socket of `target` (unix:///path, or a
// loopback host:port), found through /proc/net/{unix,tcp,tcp6} and the socket
// links under /proc/*/fd. NOT_FOUND when no readable process holds it.
absl::StatusOr<pid_t> FindListeningProcess(const std::string& target);

}  // namespace eps::load
