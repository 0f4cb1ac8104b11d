// Starts the real epsd binary for integration and fault tests: a Unix socket
// (or 127.0.0.1:0) unique to the test, stderr captured, ready once Ping answers.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "eps/v1/page_selector.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

extern char** environ;

namespace eps::testing {

inline std::string UniqueSocket(const std::string& tag) {
  static std::atomic<int> counter{0};
  return "unix:///tmp/epsd-test-" + tag + "-" + std::to_string(getpid()) + "-" +
         std::to_string(counter.fetch_add(1)) + ".sock";
}

class EpsdProcess {
 public:
  // Starts epsd with `--listen=<listen>` and `flags`; returns null if it does
  // not answer Ping within 10 s.
  static std::unique_ptr<EpsdProcess> Start(const std::string& listen,
                                            std::vector<std::string> flags = {}) {
    auto p = std::unique_ptr<EpsdProcess>(new EpsdProcess());
    p->log_ = "/tmp/epsd-test-" + std::to_string(getpid()) + "-" +
              std::to_string(reinterpret_cast<uintptr_t>(p.get())) + ".log";
    // EPSD_BIN overrides the build path (binaries carried to another machine).
    const char* binary = std::getenv("EPSD_BIN") != nullptr ? std::getenv("EPSD_BIN") : EPSD_PATH;
    // Port 0 for /metrics: tests run epsd processes side by side (a flag in `flags` wins).
    std::vector<std::string> args = {binary, "--listen=" + listen, "--backend=cpu",
                                     "--metrics-listen=127.0.0.1:0"};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 2, p->log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
    const int rc = posix_spawn(&p->pid_, binary, &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) return nullptr;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < until) {
      const std::string log = p->Log();
      const size_t at = log.find("listening on ");
      if (at != std::string::npos) {
        const size_t end = log.find(' ', at + 13);
        p->target_ = log.substr(at + 13, end - at - 13);
        if (p->PingOk()) {
          // Its socket and lock file are this epsd's to remove only once it serves them: one
          // refused on a live socket (another epsd's) must leave them alone.
          if (listen.rfind("unix://", 0) == 0) p->lock_ = listen.substr(7) + ".lock";
          return p;
        }
      }
      if (!p->Running()) return nullptr;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return nullptr;
  }

  ~EpsdProcess() {
    if (Running()) {
      kill(pid_, SIGKILL);
      Wait();
    }
    unlink(log_.c_str());
    // epsd keeps a unix socket's lock file (service/unix_socket.h), and a killed epsd its
    // socket too; each test's path is its own, so the test removes both once its epsd has
    // ended (a run of request_bounds_test left 10 sockets in /tmp).
    if (!lock_.empty()) {
      unlink(lock_.c_str());
      unlink(lock_.substr(0, lock_.size() - 5).c_str());  // less ".lock"
    }
  }

  const std::string& target() const { return target_; }
  pid_t pid() const { return pid_; }
  void Signal(int sig) {
    if (pid_ > 0) kill(pid_, sig);  // never kill(-1, ...): that signals every process
  }
  // Waits for exit; returns the exit code, or 128 + signal.
  int Wait() {
    if (exited_ || pid_ <= 0) return status_;
    int status = 0;
    waitpid(pid_, &status, 0);
    exited_ = true;
    status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return status_;
  }
  bool Running() {
    if (exited_ || pid_ <= 0) return false;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      exited_ = true;
      status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return false;
    }
    return true;
  }
  std::string Log() const {
    std::ifstream in(log_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  // The shared-memory mappings the process holds (from /proc/PID/maps).
  std::string Maps() const {
    std::ifstream in("/proc/" + std::to_string(pid_) + "/maps");
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  EpsdProcess() = default;
  bool PingOk() {
    auto channel = grpc::CreateChannel(target_, grpc::InsecureChannelCredentials());
    auto stub = v1::PageSelector::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
    context.set_wait_for_ready(true);
    v1::PingRequest request;
    v1::PingResponse response;
    return stub->Ping(&context, request, &response).ok();
  }

  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = 0;
  std::string log_, target_;
  std::string lock_;  // the unix socket's lock file, or empty
};

}  // namespace eps::testing
