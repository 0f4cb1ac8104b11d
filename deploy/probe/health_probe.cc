// eps-health-probe: asks a gRPC server's grpc.health.v1.Health/Check about one
// service and exits 0 only when the answer is SERVING.
//
// It exists for Kubernetes exec probes on epsd's Unix socket: kubelet's native
// grpc probes dial TCP ports only, and epsd's API listens on a socket inside the
// pod. One call, a bounded deadline, no retries: kubelet does the retrying.
//
// usage: eps-health-probe [--addr=unix:///run/eps/epsd.sock]
//                         [--service=eps.v1.PageSelector] [--timeout-ms=1000]
// exit:  0 SERVING; 1 any other status or a failed call; 2 bad usage.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace {

struct ProbeArgs {
  std::string addr = "unix:///run/eps/epsd.sock";
  std::string service = "eps.v1.PageSelector";
  long timeout_ms = 1000;
};

bool TakeFlag(const std::string& arg, const char* name, std::string* value) {
  const std::string prefix = std::string("--") + name + "=";
  if (arg.rfind(prefix, 0) != 0) return false;
  *value = arg.substr(prefix.size());
  return true;
}

int Usage(const std::string& why) {
  std::fprintf(stderr,
               "eps-health-probe: %s\n"
               "usage: eps-health-probe [--addr=unix:///run/eps/epsd.sock]\n"
               "                        [--service=eps.v1.PageSelector] [--timeout-ms=1000]\n",
               why.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  ProbeArgs args;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    std::string value;
    if (TakeFlag(arg, "addr", &value)) {
      if (value.empty()) return Usage("--addr is empty");
      args.addr = value;
    } else if (TakeFlag(arg, "service", &value)) {
      args.service = value;  // "" asks about the server as a whole
    } else if (TakeFlag(arg, "timeout-ms", &value)) {
      char* end = nullptr;
      args.timeout_ms = std::strtol(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || args.timeout_ms < 1 || args.timeout_ms > 60000) {
        return Usage("--timeout-ms=" + value + ": want an integer in [1, 60000]");
      }
    } else {
      return Usage("unexpected argument '" + arg + "'");
    }
  }

  auto channel = grpc::CreateChannel(args.addr, grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(args.timeout_ms));
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
