// epsd: the EPS page selector sidecar.
#include <pthread.h>

#include <csignal>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "cli/flags.h"
#include "service/config.h"
#include "service/cuda_backend.h"
#include "service/server.h"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  absl::StatusOr<eps::service::ServerConfig> config = eps::service::ParseFlags(args);
  if (!config.ok()) {
    std::fprintf(stderr, "epsd: %s (epsd --help lists the flags)\n",
                 std::string(config.status().message()).c_str());
    return 2;
  }
  if (config->help) {
    std::printf("%s", eps::service::Usage().c_str());
    return 0;
  }
  if (config->version) {
    std::printf("%s\n", eps::cli::VersionLine("epsd").c_str());
    return 0;
  }
  if (config->backend == eps::service::BackendKind::kCuda &&
      (!eps::service::CudaBackendBuilt() || !eps::service::CudaDevicePresent())) {
    std::fprintf(stderr, "epsd: --backend=cuda: %s\n",
                 eps::service::CudaBackendBuilt() ? "no CUDA device is visible"
                                                  : "this epsd was built without CUDA");
    return 2;
  }
  // Block the termination signals in every thread; one thread waits for them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<std::unique_ptr<eps::service::EpsServer>> server =
      eps::service::EpsServer::Start(*config);
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
  std::thread waiter([&] {
    int signal = 0;
    sigwait(&signals, &signal);
    std::fprintf(stderr, "epsd: signal %d, draining for up to %u ms\n", signal, config->drain_ms);
    (*server)->Shutdown();
  });
  (*server)->Wait();
  waiter.join();
  server->reset();
  std::fprintf(stderr, "epsd: stopped\n");
  return 0;
}
