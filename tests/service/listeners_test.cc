// Every epsd listener follows --listen's rule (loopback or a Unix socket unless
// --allow-remote), and the TCP health listener answers grpc.health.v1 for kubelet's
// native gRPC probes (docs/deploy-operations.md).
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "service/config.h"
#include "service/server.h"
#include "tests/service/epsd_process.h"

namespace eps::service {
namespace {

using grpc::health::v1::HealthCheckResponse;

// epsd keeps a unix socket's lock file (service/unix_socket.h); this test's are
// removed when it exits.
struct LockFiles {
  std::vector<std::string> paths;
  ~LockFiles() {
    for (const std::string& path : paths) unlink(path.c_str());
  }
};

absl::StatusOr<std::unique_ptr<EpsServer>> StartWith(std::vector<std::string> flags) {
  static LockFiles locks;
  const std::string socket = testing::UniqueSocket("listeners");
  locks.paths.push_back(socket.substr(7) + ".lock");  // after "unix://"
  flags.push_back("--listen=" + socket);
  absl::StatusOr<ServerConfig> config = ParseFlags(flags);
  if (!config.ok()) return config.status();
  return EpsServer::Start(*config);
}

// The health status of `service` at `address`, or the call's error.
absl::StatusOr<HealthCheckResponse::ServingStatus> Check(const std::string& address,
                                                         const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) return absl::UnavailableError(status.error_message());
  return response.status();
}

TEST(ListenersTest, MetricsListenBeyondLoopbackNeedsAllowRemote) {
  const auto refused = StartWith({"--metrics-listen=0.0.0.0:0"});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("--metrics-listen=0.0.0.0:0"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("--allow-remote"), std::string::npos);
  EXPECT_TRUE(StartWith({"--metrics-listen=0.0.0.0:0", "--allow-remote"}).ok());
  EXPECT_TRUE(StartWith({"--metrics-listen=127.0.0.1:0"}).ok());
}

TEST(ListenersTest, HealthListenBeyondLoopbackNeedsAllowRemote) {
  const auto refused = StartWith({"--metrics-listen=off", "--health-listen=0.0.0.0:0"});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("--health-listen=0.0.0.0:0"), std::string::npos)
      << refused.status();
  EXPECT_TRUE(
      StartWith({"--metrics-listen=off", "--health-listen=0.0.0.0:0", "--allow-remote"}).ok());
}

TEST(ListenersTest, HealthListenServesGrpcHealthOverTcpWithoutTheApi) {
  // Port 0: the kernel picks a free port and the server reports it (a port found free
  // beforehand could be taken by another process before epsd binds it).
  auto server = StartWith({"--metrics-listen=off", "--health-listen=127.0.0.1:0"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->health_address();
  ASSERT_EQ(address.rfind("127.0.0.1:", 0), 0u) << address;
  ASSERT_NE(address, "127.0.0.1:0");
  EXPECT_EQ(Check(address, "").value_or(HealthCheckResponse::UNKNOWN),
            HealthCheckResponse::SERVING);
  EXPECT_EQ(Check(address, "eps.v1.PageSelector").value_or(HealthCheckResponse::UNKNOWN),
            HealthCheckResponse::SERVING);
  // The TCP port carries health only: the page-selection API stays on the socket.
  auto api =
      v1::PageSelector::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::PingRequest ping;
  v1::PingResponse pong;
  EXPECT_EQ(api->Ping(&context, ping, &pong).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  // Draining: the probe must see NOT_SERVING (or no server), never SERVING.
  (*server)->Shutdown();
  EXPECT_NE(Check(address, "").value_or(HealthCheckResponse::NOT_SERVING),
            HealthCheckResponse::SERVING);
}

TEST(ListenersTest, ASecondServerCannotShareATakenHealthOrApiPort) {
  // gRPC binds with SO_REUSEPORT by default: a second epsd on the same port would
  // split the probes between two processes instead of failing.
  // The first binds port 0 (the kernel picks a free one); the second asks for that port.
  auto first = StartWith({"--metrics-listen=off", "--health-listen=127.0.0.1:0"});
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string health = (*first)->health_address();
  ASSERT_EQ(health.rfind("127.0.0.1:", 0), 0u) << health;
  ASSERT_NE(health, "127.0.0.1:0");
  const auto second = StartWith({"--metrics-listen=off", "--health-listen=" + health});
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("--health-listen"), std::string::npos)
      << second.status();

  auto one = EpsServer::Start(*ParseFlags({"--listen=127.0.0.1:0", "--metrics-listen=off"}));
  ASSERT_TRUE(one.ok()) << one.status();
  const std::string api = (*one)->bound_address();
  ASSERT_EQ(api.rfind("127.0.0.1:", 0), 0u) << api;
  ASSERT_NE(api, "127.0.0.1:0");
  EXPECT_FALSE(EpsServer::Start(*ParseFlags({"--listen=" + api, "--metrics-listen=off"})).ok());
}

TEST(ListenersTest, HealthListenTakesHostAndPortOrOff) {
  EXPECT_TRUE(ParseFlags({"--health-listen=off"}).ok());
  EXPECT_TRUE(ParseFlags({"--health-listen=[::1]:8081"}).ok());
  EXPECT_FALSE(ParseFlags({"--health-listen=8081"}).ok());
}

}  // namespace
}  // namespace eps::service
