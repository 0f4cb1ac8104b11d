#include "service/epsd_main.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "cli/flags.h"
#include "service/config.h"
#include "service/cuda_backend.h"
#include "service/server.h"
#include "service/telemetry/step_log.h"

namespace eps::service {

absl::StatusOr<std::string> PrepareCuda(BackendKind backend,
                                        const std::function<absl::Status()>& warm_up) {
  const auto start = std::chrono::steady_clock::now();
  if (absl::Status s = warm_up(); !s.ok()) {
    if (backend == BackendKind::kCuda) return s;
    const std::string reason = absl::StrCat("the CUDA warm-up failed at start (", s.message(), ")");
    DisableCuda(reason);
    return absl::StrCat(reason, "; --backend=auto serves the cpu backend only, and a cuda Attach ",
                        "is refused FAILED_PRECONDITION");
  }
  return absl::StrCat("CUDA ready on ", CudaDeviceCount(), " device(s) in ",
                      std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::steady_clock::now() - start)
                          .count(),
                      " ms");
}

int RunEpsd(const std::vector<std::string>& args, BackendFactory make_backend) {
  // Block the termination signals before any thread exists, so that every thread
  // inherits the mask and one thread waits for them (sigwait below). The CUDA driver
  // starts threads of its own at the device checks and the warm-up: blocked only after
  // those, a SIGTERM could be delivered to one of them and end the process at once,
  // without the drain.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // Each session's stream waits on its engine's inputs_ready in a hardware queue;
  // streams that share a queue wait behind each other (docs/design.md §6). CUDA's
  // default is 8 queues per process; take its maximum, 32, unless the operator chose.
  // Before anything starts CUDA.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  absl::StatusOr<ServerConfig> config = ParseFlags(args);
  if (!config.ok()) {
    std::fprintf(stderr, "epsd: %s (epsd --help lists the flags)\n",
                 std::string(config.status().message()).c_str());
    return 2;
  }
  if (config->help) {
    std::printf("%s", Usage().c_str());
    return 0;
  }
  if (config->version) {
    std::printf("%s\n", eps::cli::VersionLine("epsd").c_str());
    return 0;
  }
  // A step log that cannot be opened is a bad command line (exit 2, docs/cli.md), found
  // here before the listeners rather than by the server's start (exit 1). The server's
  // telemetry writes the file opened here.
  std::unique_ptr<telemetry::StepLog> step_log;
  if (!config->step_log.empty()) {
    absl::StatusOr<std::unique_ptr<telemetry::StepLog>> log =
        telemetry::StepLog::Open(config->step_log);
    if (!log.ok()) {
      std::fprintf(stderr, "epsd: %s\n", std::string(log.status().message()).c_str());
      return 2;
    }
    step_log = *std::move(log);
  }
  if (config->backend == BackendKind::kCuda && (!CudaBackendBuilt() || !CudaDevicePresent())) {
    std::fprintf(
        stderr, "epsd: --backend=cuda: %s\n",
        CudaBackendBuilt() ? "no CUDA device is visible" : "this epsd was built without CUDA");
    return 2;
  }
  if (config->backend != BackendKind::kCpu && CudaDevicePresent()) {
    absl::StatusOr<std::string> cuda = PrepareCuda(config->backend, WarmUpCuda);
    if (!cuda.ok()) {
      std::fprintf(stderr, "epsd: CUDA warm-up: %s\n",
                   std::string(cuda.status().message()).c_str());
      return 1;
    }
    std::fprintf(stderr, "epsd: %s\n", cuda->c_str());
  }
  // A lost CUDA device ends epsd as a signal does (the drain), then with exit 1: only a
  // new process can use the device again, and a supervisor restarts it.
  absl::StatusOr<std::unique_ptr<EpsServer>> server =
      EpsServer::Start(*config, {.on_fatal = [] { kill(getpid(), SIGTERM); },
                                 .make_backend = std::move(make_backend),
                                 .step_log = std::move(step_log)});
  if (!server.ok()) {
    std::fprintf(stderr, "epsd: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  static constexpr const char* kBackends[] = {"cpu", "cuda", "auto"};
  std::fprintf(stderr, "epsd: listening on %s (backend %s, lease %u ms)\n",
               (*server)->bound_address().c_str(), kBackends[static_cast<int>(config->backend)],
               config->lease_ms);
  for (const std::string& warning : (*server)->telemetry().warnings()) {
    std::fprintf(stderr, "epsd: warning: %s\n", warning.c_str());
  }
  std::fprintf(stderr, "epsd: %s\n", (*server)->telemetry().Describe().c_str());
  if (!(*server)->health_address().empty()) {
    std::fprintf(stderr, "epsd: grpc.health.v1 on %s\n", (*server)->health_address().c_str());
  }
  absl::Notification stopped;        // the server is gone (main)
  absl::Notification shutdown_done;  // Shutdown returned (the waiter)
  std::thread backstop;
  std::thread waiter([&] {
    int signal = 0;
    sigwait(&signals, &signal);
    if (absl::Status fatal = (*server)->fatal(); !fatal.ok()) {
      std::fprintf(stderr, "epsd: stopping (%s), draining for up to %u ms\n",
                   std::string(fatal.message()).c_str(), config->drain_ms);
    } else {
      std::fprintf(stderr, "epsd: signal %d, draining for up to %u ms\n", signal, config->drain_ms);
    }
    // The backstop of the drain: gRPC cancels the calls left at drain_ms, and every call
    // ends then (service/call_guard.h); should one still not, exit regardless.
    // After the drain, the span flush takes up to 2 s (an export still in flight is
    // cancelled at its end); 2.5 s ended drains of 200 ms in the backstop (exit 1) with a
    // dead collector, so 4 s. A call that waits for an engine's inputs (an async
    // step's Finish) cannot be cancelled: it ends within --inputs-timeout-ms, then the
    // release's drain bound (5 s, gpu::GpuSelectorOptions::drain_timeout).
    // Armed at the signal, not once Shutdown returns: Shutdown waits for every call to
    // end, so a call that outlived its cancel held the backstop off with it.
    const uint32_t bound_ms =
        config->drain_ms + std::max<uint32_t>(4000, config->inputs_timeout_ms + 5000);
    backstop = std::thread([&stopped, bound_ms] {
      if (!stopped.WaitForNotificationWithTimeout(absl::Milliseconds(bound_ms))) {
        std::fprintf(stderr, "epsd: drain timed out %u ms after the signal; exiting\n", bound_ms);
        std::_Exit(1);
      }
    });
    (*server)->Shutdown();
    shutdown_done.Notify();
  });
  (*server)->Wait();
  // One thread shuts the server down: the waiter's Shutdown may still be stopping the
  // health server when the main one's Wait returns.
  shutdown_done.WaitForNotification();
  const bool fatal = !(*server)->fatal().ok();
  server->reset();
  stopped.Notify();
  waiter.join();
  backstop.join();
  std::fprintf(stderr, "epsd: stopped%s\n", fatal ? " (a CUDA device was lost: exit 1)" : "");
  return fatal ? 1 : 0;
}

}  // namespace eps::service
