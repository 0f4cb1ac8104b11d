// epsd's process: the flags, the CUDA warm-up, the server, and its end: a drain on
// SIGTERM or SIGINT (exit 0), or on a lost CUDA device, after which the server signals
// its own process (exit 1). main() is one call; docs/cli.md lists the exit statuses.
#pragma once

#include <string>
#include <vector>

#include "service/session.h"

namespace eps::service {

// Runs epsd with `args` (argv without the program name) and returns its exit status.
// It blocks SIGTERM and SIGINT in the calling thread first and waits for them on a
// thread of its own, so call it before any other thread exists (every thread must
// inherit the mask, or a signal may end the process without the drain), and once per
// process. `make_backend`: the sessions' backends (tests pass stand-ins).
int RunEpsd(const std::vector<std::string>& args, BackendFactory make_backend = MakeSessionBackend);

}  // namespace eps::service
