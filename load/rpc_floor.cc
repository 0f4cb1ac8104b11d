#include "load/rpc_floor.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "eps/v1/page_selector.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace eps::load {
namespace {

using Clock = std::chrono::steady_clock;

// Ping, and nothing else: the least a callback-API server can do for a call.
class FloorService final : public v1::PageSelector::CallbackService {
  grpc::ServerUnaryReactor* Ping(grpc::CallbackServerContext* context, const v1::PingRequest*,
                                 v1::PingResponse*) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

absl::Status SyncPing(v1::PageSelector::Stub& stub, std::chrono::microseconds deadline) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + deadline);
  v1::PingResponse response;
  const grpc::Status status = stub.Ping(&context, v1::PingRequest(), &response);
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::shared_ptr<grpc::Channel> Channel(const std::string& target, const LoadConfig& config) {
  grpc::ChannelArguments args;
  for (const auto& [key, value] : config.channel_args) args.SetInt(key, value);
  // A connection of its own, not shared with other channels to the same target.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

// read(2), again after a signal's handler interrupted it (eps-load installs its handlers
// with SA_RESTART; this holds without it too).
ssize_t ReadRetryingSignals(int fd, void* buffer, size_t size) {
  ssize_t n;
  do {
    n = read(fd, buffer, size);
  } while (n < 0 && errno == EINTR);
  return n;
}

// waitpid(2) for `child`, again after a signal's handler interrupted it.
void ReapChild(pid_t child) {
  while (waitpid(child, nullptr, 0) < 0 && errno == EINTR) {
  }
}

// The minimal server on the transport of `target`: a Unix socket beside it, or a
// kernel-chosen loopback port. Sets `*address`; null when it cannot listen.
std::unique_ptr<grpc::Server> StartFloorServer(bool unix_socket, const std::string& socket_path,
                                               FloorService* service, std::string* address) {
  grpc::ServerBuilder builder;
  int port = 0;
  if (unix_socket) {
    unlink(socket_path.c_str());
    *address = absl::StrCat("unix://", socket_path);
    builder.AddListeningPort(*address, grpc::InsecureServerCredentials());
  } else {
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  }
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server != nullptr && !unix_socket) *address = absl::StrCat("127.0.0.1:", port);
  return server;
}

// The minimal server in a child process, as epsd is one: forked before this process
// starts gRPC, it holds a gRPC instance and threads of its own. Ends when `stop_fd`
// (the read end of a pipe) sees end-of-file.
[[noreturn]] void RunFloorChild(bool unix_socket, const std::string& socket_path, int ready_fd,
                                int stop_fd) {
  // The parent ends this process through the pipe: a terminal's Ctrl-C, sent to the
  // whole process group, must not end the floor server under the parent's last round.
  signal(SIGINT, SIG_IGN);
  signal(SIGTERM, SIG_IGN);
  FloorService service;
  std::string address;
  std::unique_ptr<grpc::Server> server =
      StartFloorServer(unix_socket, socket_path, &service, &address);
  const std::string message = server == nullptr ? std::string("-") : address;
  (void)!write(ready_fd, message.data(), message.size());
  close(ready_fd);
  char byte;
  while (ReadRetryingSignals(stop_fd, &byte, 1) > 0) {
  }
  if (server != nullptr) server->Shutdown();
  if (unix_socket) unlink(socket_path.c_str());
  _exit(0);
}

}  // namespace

absl::Status CallbackPing(v1::PageSelector::Stub& stub, std::chrono::microseconds deadline) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + deadline);
  v1::PingRequest request;
  v1::PingResponse response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  stub.async()->Ping(&context, &request, &response, [&](grpc::Status s) {
    std::lock_guard lock(mu);
    status = std::move(s);
    done = true;
    cv.notify_all();
  });
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return done; });
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

absl::StatusOr<FloorResult> MeasureFloor(const LoadConfig& config, const std::atomic<bool>* stop) {
  FloorResult result;
  const bool unix_socket = absl::StartsWith(config.target, "unix:");
  const std::string socket_path = absl::StrCat("/tmp/eps-load-floor-", getpid(), ".sock");
  FloorService service;
  std::unique_ptr<grpc::Server> server;
  pid_t child = 0;
  int stop_fd = -1;
  if (config.floor_in_process) {
    result.where = "in-process";
    server = StartFloorServer(unix_socket, socket_path, &service, &result.floor_address);
    if (server == nullptr) return absl::UnavailableError("the floor server cannot listen");
  } else {
    result.where = "child process";
    int ready[2], quit[2];
    if (pipe2(ready, O_CLOEXEC) != 0 || pipe2(quit, O_CLOEXEC) != 0) {
      return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
    }
    child = fork();
    if (child < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
    if (child == 0) {
      close(ready[0]);
      close(quit[1]);
      RunFloorChild(unix_socket, socket_path, ready[1], quit[0]);
    }
    close(ready[1]);
    close(quit[0]);
    stop_fd = quit[1];
    char buffer[256];
    std::string address;
    ssize_t n;
    // A signal's handler can interrupt this read (without SA_RESTART); the stop is seen below.
    while ((n = ReadRetryingSignals(ready[0], buffer, sizeof(buffer))) > 0) {
      address.append(buffer, n);
    }
    close(ready[0]);
    if (address.empty() || address == "-") {
      close(stop_fd);
      ReapChild(child);
      return absl::UnavailableError("the floor server (child process) cannot listen");
    }
    result.floor_address = address;
  }

  auto floor = v1::PageSelector::NewStub(Channel(result.floor_address, config));
  auto epsd = v1::PageSelector::NewStub(Channel(config.target, config));
  struct Kind {
    const char* name;
    v1::PageSelector::Stub* stub;
    std::function<absl::Status(v1::PageSelector::Stub&, std::chrono::microseconds)> call;
    LatencySamples* samples;
  };
  const Kind kinds[] = {
      {"floor, callback client", floor.get(), CallbackPing, &result.floor_callback},
      {"epsd Ping, callback client", epsd.get(), CallbackPing, &result.ping_callback},
      {"floor, sync client", floor.get(), SyncPing, &result.floor_sync},
      {"epsd Ping, sync client", epsd.get(), SyncPing, &result.ping_sync}};
  result.warmup_rounds = std::max(10, config.floor_calls / 10);
  auto stopping = [&] { return stop != nullptr && stop->load(); };
  // One Ping first: an epsd that is not there (or stopped) fails it once, within one
  // deadline, instead of failing every call of every round.
  if (const absl::Status first = CallbackPing(*epsd, config.deadline); !first.ok()) {
    result.aborted = absl::StrCat("epsd did not answer a Ping: ", first.ToString());
  }
  for (int round = -result.warmup_rounds;
       result.aborted.empty() && !result.stopped && round < config.floor_calls; ++round) {
    // A round's samples count only once all four calls of it are in, so that a stop or a
    // failure mid-round leaves every kind with the same number of samples.
    double round_us[std::size(kinds)] = {};
    size_t done = 0;
    for (const Kind& kind : kinds) {
      // Checked before every call, so SIGINT waits for one call at most, not a round.
      if (stopping()) {
        result.stopped = true;
        break;
      }
      const Clock::time_point start = Clock::now();
      const absl::Status status = kind.call(*kind.stub, config.deadline);
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      if (!status.ok()) {
        ++(round < 0 ? result.warmup_errors : result.errors);
        result.aborted = absl::StrCat(
            kind.name, " failed in ", round < 0 ? "warm-up round " : "measured round ",
            round < 0 ? round + result.warmup_rounds + 1 : round + 1, ": ", status.ToString());
        break;
      }
      round_us[done++] = us;
    }
    if (round >= 0 && done == std::size(kinds)) {
      for (size_t k = 0; k < done; ++k) kinds[k].samples->Record(round_us[k]);
      ++result.rounds;
    }
  }
  if (server != nullptr) {
    server->Shutdown();
    if (unix_socket) unlink(socket_path.c_str());
  } else {
    close(stop_fd);  // the child's end-of-file: it shuts down and exits
    ReapChild(child);
  }
  return result;
}

}  // namespace eps::load
