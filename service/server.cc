#include "service/server.h"

#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace eps::service {

absl::StatusOr<std::unique_ptr<EpsServer>> EpsServer::Start(const ServerConfig& config,
                                                            ServerHooks hooks) {
  if (absl::Status s = CheckListeners(config); !s.ok()) return s;
  auto server = std::unique_ptr<EpsServer>(new EpsServer());
  server->config_ = config;
  server->on_fatal_ = std::move(hooks.on_fatal);
  EpsServer* const self = server.get();
  server->executor_ = StepExecutor::ForSessions(config.max_sessions);
  server->sessions_ = std::make_unique<SessionService>(
      config,
      [self](const absl::Status& lost) {
        {
          absl::MutexLock lock(&self->fatal_mu_);
          self->fatal_ = lost;
        }
        if (self->on_fatal_) self->on_fatal_();
      },
      std::move(hooks.make_backend), server->executor_.get());
  const bool is_unix = absl::StartsWith(config.listen, "unix://");
  if (is_unix) {
    // Bound first (connections wait in its backlog until the acceptor starts), and owned
    // from here on: only this server removes it, whichever later step fails.
    absl::StatusOr<std::unique_ptr<ListeningUnixSocket>> socket =
        ListeningUnixSocket::Bind(config.listen.substr(7), config.socket_mode);
    if (!socket.ok()) return socket.status();
    server->socket_ = *std::move(socket);
  }
  // After the socket check: a second epsd on a live socket must say so, not fail on the port.
  SessionService* sessions = server->sessions_.get();
  if (hooks.step_log == nullptr && !config.step_log.empty()) {  // a caller other than RunEpsd
    absl::StatusOr<std::unique_ptr<telemetry::StepLog>> log =
        telemetry::StepLog::Open(config.step_log);
    if (!log.ok()) return log.status();
    hooks.step_log = *std::move(log);
  }
  absl::StatusOr<std::unique_ptr<telemetry::Telemetry>> telemetry = telemetry::Telemetry::Create(
      {.metrics_listen = config.metrics_listen, .step_log = std::move(hooks.step_log)},
      telemetry::ProcessEnv(), [sessions] {
        v1::GetStatsResponse stats;
        (void)sessions->GetStats(v1::GetStatsRequest(), &stats);
        return telemetry::ScrapeSources::Sessions{.active = stats.sessions_active(),
                                                  .attached_total = stats.sessions_attached_total(),
                                                  .expired_total = stats.sessions_expired_total(),
                                                  .charged_bytes = sessions->charged_bytes(),
                                                  .ending = sessions->sessions_ending()};
      });
  if (!telemetry.ok()) return telemetry.status();
  server->telemetry_ = *std::move(telemetry);
  server->service_ = std::make_unique<PageSelectorService>(*server->sessions_, *server->telemetry_,
                                                           is_unix ? &server->peers_ : nullptr);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default: a second server on a taken TCP port would share
  // it (the kernel splitting connections between the two) instead of failing.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Streams at once on one connection (an engine's client holds one step stream and a few
  // unary calls): without a cap one peer opened 20,000 idle streams on one connection, each
  // a reactor with a read pending (about 17 KB apiece, 363 MB, charged to no budget). Past
  // it the peer's further streams wait in its own client.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
  int port = 0;
  // The Unix socket is epsd's own (UnixAcceptor): it reads each peer's credentials.
  if (!is_unix) builder.AddListeningPort(config.listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(server->service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(config.max_message_bytes));
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    // gRPC has logged why; the likeliest cause is a port another process holds.
    return absl::UnavailableError(
        absl::StrCat("--listen=", config.listen, ": could not bind it (is the port in use?)"));
  }
  if (auto* health = server->server_->GetHealthCheckService()) {
    health->SetServingStatus(v1::PageSelector::service_full_name(), true);
  }
  if (!config.health_listen.empty()) {
    if (absl::Status s = server->StartHealthListener(); !s.ok()) return s;
  }
  server->bound_address_ = config.listen;
  if (!is_unix) {
    const size_t colon = config.listen.rfind(':');
    server->bound_address_ = absl::StrCat(config.listen.substr(0, colon), ":", port);
  }
  if (is_unix) {
    absl::StatusOr<std::unique_ptr<UnixAcceptor>> acceptor =
        UnixAcceptor::Start(server->socket_->fd(), *server->server_, server->peers_);
    if (!acceptor.ok()) return acceptor.status();
    server->acceptor_ = *std::move(acceptor);
  }
  return server;
}

absl::Status EpsServer::StartHealthListener() {
  // A server of its own with grpc.health.v1 (the default service that
  // EnableDefaultHealthCheckService adds to every server) and gRPC server reflection
  // (registered for every server of the process; without it gRPC 1.51 finds no service
  // that needs its polling threads and refuses to start one with only the default health
  // service): the TCP port that kubelet probes must not carry the page-selection API,
  // which stays on --listen.
  grpc::ServerBuilder builder;
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a taken port is an error
  // It faces the pod network, and a probe is one short call: a connection carries at
  // most 4 streams, and is closed once idle for 30 s or 5 min old (5 s to finish), so
  // that Watch streams or idle connections cannot pile up for good (3,000 Watch streams
  // held 54 MB until then). No thread or memory quota: one made a Check wait behind the
  // Watch streams holding the quota, and a probe that cannot answer restarts the pod.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 4);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, 30'000);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS, 300'000);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS, 5'000);
  builder.SetMaxReceiveMessageSize(4 << 10);
  int port = 0;
  builder.AddListeningPort(config_.health_listen, grpc::InsecureServerCredentials(), &port);
  health_server_ = builder.BuildAndStart();
  if (health_server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("--health-listen=", config_.health_listen,
                                               ": could not bind it (is the port in use?)"));
  }
  if (auto* health = health_server_->GetHealthCheckService()) {
    health->SetServingStatus(v1::PageSelector::service_full_name(), true);
  }
  health_address_ =
      absl::StrCat(config_.health_listen.substr(0, config_.health_listen.rfind(':')), ":", port);
  return absl::OkStatus();
}

void EpsServer::Shutdown() {
  if (acceptor_ != nullptr) acceptor_->Stop();  // no new connection from here on
  if (server_ == nullptr) return;
  // Probes see NOT_SERVING while calls drain, then the health port closes.
  if (auto* health = server_->GetHealthCheckService()) health->Shutdown();
  if (health_server_ != nullptr) {
    if (auto* health = health_server_->GetHealthCheckService()) health->Shutdown();
  }
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(config_.drain_ms));
  if (health_server_ != nullptr) health_server_->Shutdown(std::chrono::system_clock::now());
}

void EpsServer::Wait() {
  if (server_ != nullptr) server_->Wait();
  if (health_server_ != nullptr) health_server_->Wait();
}

EpsServer::~EpsServer() {
  Shutdown();
  Wait();
  // Every call has ended, those answered from the executor included (the server waits for
  // them): its threads end once the gate work they still hold is done, before the
  // sessions go.
  if (executor_ != nullptr) executor_->Stop();
  // No call is running now: send the spans still queued, for at most 2 s (a dead collector
  // must not hold up the exit).
  if (telemetry_ != nullptr) telemetry_->Shutdown(std::chrono::milliseconds(2000));
  // socket_, when bound, removes its file (only if still its own) after acceptor_ stops.
}

}  // namespace eps::service
