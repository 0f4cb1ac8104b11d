// eps-health-probe: asks a gRPC server's grpc.health.v1.Health/Check about one
// service and exits 0 only when the answer is SERVING.
//
// For the container image's HEALTHCHECK and for operators (kubectl exec, docker
// exec): Kubernetes itself probes epsd's --health-listen port natively
// (docs/deploy-operations.md). One call, a bounded deadline, no retries.
//
// usage: eps-health-probe [--addr=unix:///run/eps/epsd.sock]
//                         [--service=eps.v1.PageSelector] [--timeout-ms=1s]
// exit:  0 SERVING; 1 any other status or a failed call; 2 bad usage.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/flags/flag.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/flags.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, addr, "unix:///run/eps/epsd.sock",
          "the server: unix:///path (absolute) or host:port with a port in [1, 65535] (epsd's "
          "--listen or --health-listen)");
ABSL_FLAG(std::string, service, "eps.v1.PageSelector",
          "the service to ask about (\"\" asks about the server as a whole)");
ABSL_FLAG(eps::cli::Millis, timeout_ms, {absl::Milliseconds(1000)},
          "the call's deadline, in [1ms, 60s] (a bare number is ms)");

struct ProbeArgs {
  std::string addr;
  std::string service;
  absl::Duration timeout;
};

int main(int argc, char** argv) {
  ProbeArgs args;
  const int done =
      eps::cli::ParseMain(argc, argv, "eps-health-probe", "eps-health-probe [flags]", [&] {
        args.addr = absl::GetFlag(FLAGS_addr);
        args.service = absl::GetFlag(FLAGS_service);
        // Dialled as the clients dial --target: gRPC would otherwise wrap 99999, dial port 0
        // for "abc" and 443 for a bare host, and read unix://relative.sock as an authority.
        // Checked here so that a bad --addr exits 2, not 1 after a call.
        if (absl::Status s = eps::cli::CheckDialTarget(FLAGS_addr); !s.ok()) return s;
        return eps::cli::ReadDuration(FLAGS_timeout_ms, absl::Milliseconds(1), absl::Seconds(60),
                                      &args.timeout);
      });
  if (done >= 0) return done;

  auto channel = grpc::CreateChannel(args.addr, grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + args.timeout));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(args.service);
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) {
    std::fprintf(stderr, "eps-health-probe: %s service '%s': %s (code %d)\n", args.addr.c_str(),
                 args.service.c_str(), status.error_message().c_str(),
                 static_cast<int>(status.error_code()));
    return 1;
  }
  const std::string name =
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
  std::printf("eps-health-probe: %s service '%s': %s\n", args.addr.c_str(), args.service.c_str(),
              name.c_str());
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
}
