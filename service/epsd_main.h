// epsd's process: the flags, the CUDA warm-up, the server, and its end: a drain on
// SIGTERM or SIGINT (exit 0), or on a lost CUDA device, after which the server signals
// its own process (exit 1). main() is one call; docs/cli.md lists the exit statuses.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "service/backend_kind.h"
#include "service/session.h"

namespace eps::service {

// Runs epsd with `args` (argv without the program name) and returns its exit status.
// It blocks SIGTERM and SIGINT in the calling thread first and waits for them on a
// thread of its own, so call it before any other thread exists (every thread must
// inherit the mask, or a signal may end the process without the drain), and once per
// process. `make_backend`: the sessions' backends (tests pass stand-ins).
int RunEpsd(const std::vector<std::string>& args, BackendFactory make_backend = MakeSessionBackend);

// The CUDA warm-up at start, for a server whose --backend is `backend` (not cpu) on a
// machine with a visible device: the line to log when CUDA is ready, or when the warm-up
// failed under --backend=auto (CUDA is then taken out of service, DisableCuda, and epsd
// serves the cpu backend); the warm-up's error under --backend=cuda (epsd exits 1).
absl::StatusOr<std::string> PrepareCuda(BackendKind backend,
                                        const std::function<absl::Status()>& warm_up);

}  // namespace eps::service
