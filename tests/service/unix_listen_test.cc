// --listen=unix:///path: epsd binds the path only when it is free or holds a dead
// server's socket, and removes only the socket it bound (service/unix_socket.h).
#include <signal.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "service/config.h"
#include "service/server.h"
#include "tests/service/epsd_process.h"

extern char** environ;

namespace eps::service {
namespace {

// A fresh directory for one test, and the socket path in it; removed at the end.
class UnixListenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/epsd-unix-listen-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr) << std::strerror(errno);
    dir_ = dir;
    path_ = dir_ + "/epsd.sock";
  }
  void TearDown() override { (void)!system(("rm -rf " + dir_).c_str()); }

  // The config on this test's path. Flags are process-wide: parse on one thread only.
  ServerConfig Config() {
    absl::StatusOr<ServerConfig> config =
        ParseFlags({"--listen=unix://" + path_, "--metrics-listen=off"});
    EXPECT_TRUE(config.ok()) << config.status();
    return config.ok() ? *config : ServerConfig{};
  }
  absl::StatusOr<std::unique_ptr<EpsServer>> Start() { return EpsServer::Start(Config()); }

  std::string dir_, path_;
};

// A socket bound at `path`, listening when `listen` (else a dead server's leftover).
int BindAt(const std::string& path, bool listening) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) return -1;
  if (listening && listen(fd, 4) != 0) return -1;
  return fd;
}

bool IsSocket(const std::string& path) {
  struct stat info {};
  return lstat(path.c_str(), &info) == 0 && S_ISSOCK(info.st_mode);
}

ino_t InodeOf(const std::string& path) {
  struct stat info {};
  return lstat(path.c_str(), &info) == 0 ? info.st_ino : 0;
}

// RunEpsd hands Start the step log it opened; a caller that sets only the path (an
// embedding process, a test) gets the log opened by Start, or Start's refusal.
TEST_F(UnixListenTest, AStartGivenOnlyTheStepLogsPathOpensItOrFails) {
  ServerConfig config = Config();
  config.step_log = dir_ + "/steps.jsonl";
  {
    absl::StatusOr<std::unique_ptr<EpsServer>> server = EpsServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    EXPECT_EQ(access(config.step_log.c_str(), W_OK), 0) << "Start did not open the step log";
    (*server)->Shutdown();
  }
  config.step_log = dir_ + "/no-such-directory/steps.jsonl";
  absl::StatusOr<std::unique_ptr<EpsServer>> refused = EpsServer::Start(config);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().ToString().find(config.step_log), std::string::npos)
      << refused.status();
}

TEST_F(UnixListenTest, TwoServersStartingTogetherLeaveTheWinnersSocket) {
  // The loser of the start race once removed the winner's socket on its way out.
  // Both threads start from one config: parsing flags on two threads at once races on the
  // process-wide flags (one thread once got the default path).
  const ServerConfig config = Config();
  for (int round = 0; round < 8; ++round) {
    absl::StatusOr<std::unique_ptr<EpsServer>> a = absl::UnknownError("not run");
    absl::StatusOr<std::unique_ptr<EpsServer>> b = absl::UnknownError("not run");
    std::thread first([&] { a = EpsServer::Start(config); });
    std::thread second([&] { b = EpsServer::Start(config); });
    first.join();
    second.join();
    ASSERT_NE(a.ok(), b.ok()) << "round " << round << ": " << a.status() << " / " << b.status();
    const absl::Status& refused = a.ok() ? b.status() : a.status();
    EXPECT_NE(refused.message().find("another server is listening"), std::string::npos) << refused;
    EXPECT_TRUE(IsSocket(path_)) << "round " << round << ": the winner's socket is gone";
    a = absl::UnknownError("stopped");
    b = absl::UnknownError("stopped");
    EXPECT_FALSE(IsSocket(path_)) << "the winner left its socket behind";
  }
}

TEST_F(UnixListenTest, AServerRemovesOnlyTheSocketItBound) {
  auto server = Start();
  ASSERT_TRUE(server.ok()) << server.status();
  // Someone removes the file and another server binds the path meanwhile.
  ASSERT_EQ(unlink(path_.c_str()), 0);
  const int other = BindAt(path_, /*listening=*/true);
  ASSERT_GE(other, 0) << std::strerror(errno);
  const ino_t others = InodeOf(path_);
  server->reset();
  EXPECT_EQ(InodeOf(path_), others) << "the other server's socket was removed";
  close(other);
}

TEST_F(UnixListenTest, ASocketNobodyListensOnIsTakenOver) {
  const int dead = BindAt(path_, /*listening=*/false);
  ASSERT_GE(dead, 0) << std::strerror(errno);
  auto server = Start();
  EXPECT_TRUE(server.ok()) << server.status();
  close(dead);
}

TEST_F(UnixListenTest, ALiveServersSocketIsRefusedAndKept) {
  const int live = BindAt(path_, /*listening=*/true);
  ASSERT_GE(live, 0) << std::strerror(errno);
  const ino_t inode = InodeOf(path_);
  auto server = Start();
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find("another server is listening on " + path_),
            std::string::npos)
      << server.status();
  EXPECT_EQ(InodeOf(path_), inode);
  close(live);
}

TEST_F(UnixListenTest, AFileThatIsNotASocketIsRefusedAndKept) {
  std::ofstream(path_) << "keep me";
  auto server = Start();
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find("is not a socket"), std::string::npos)
      << server.status();
  std::ifstream in(path_);
  std::stringstream content;
  content << in.rdbuf();
  EXPECT_EQ(content.str(), "keep me");
}

TEST_F(UnixListenTest, APathTooLongForASocketIsRefusedBeforeAnythingIsRemoved) {
  const std::string long_path = dir_ + "/" + std::string(120, 'x');
  std::ofstream(long_path) << "keep me";
  const auto parsed = ParseFlags({"--listen=unix://" + long_path});
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("--listen=unix://"), std::string::npos)
      << parsed.status();
  EXPECT_NE(parsed.status().message().find("at most 107 bytes"), std::string::npos)
      << parsed.status();
  // A config made without the flags is refused by the server as well.
  ServerConfig config;
  config.listen = "unix://" + long_path;
  config.metrics_listen.clear();
  EXPECT_FALSE(EpsServer::Start(config).ok());
  struct stat info {};
  EXPECT_EQ(lstat(long_path.c_str(), &info), 0) << "the file was removed";
}

// Runs epsd on `path` as user nobody (as root) or as this user; its exit code, or -1 if
// it was still running after 10 s (it took the path over).
int RunEpsdAsAnotherUser(const std::string& path, std::string* log) {
  const std::string log_path = path + ".log";
  std::vector<std::string> args;
  if (geteuid() == 0) {
    args = {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"};
  }
  args.insert(args.end(),
              {EPSD_PATH, "--listen=unix://" + path, "--metrics-listen=off", "--backend=cpu"});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 2, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0644);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return -2;
  int status = 0;
  int code = -1;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < until) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (code == -1) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  std::ifstream in(log_path);
  std::stringstream s;
  s << in.rdbuf();
  *log = s.str();
  return code;
}

TEST_F(UnixListenTest, ASocketItCannotConnectToIsRefusedNotTakenOver) {
  // A live socket the other user may not connect to (EACCES), in a directory where it
  // could remove it: it must not take it for a dead one.
  ASSERT_EQ(chmod(dir_.c_str(), 0777), 0);
  const int live = BindAt(path_, /*listening=*/true);
  ASSERT_GE(live, 0) << std::strerror(errno);
  ASSERT_EQ(chmod(path_.c_str(), 0), 0);
  const ino_t inode = InodeOf(path_);
  std::string log;
  EXPECT_EQ(RunEpsdAsAnotherUser(path_, &log), 1) << log;
  EXPECT_NE(log.find("cannot tell whether a server is listening"), std::string::npos) << log;
  EXPECT_EQ(InodeOf(path_), inode) << "the live socket was replaced";
  close(live);
}

}  // namespace
}  // namespace eps::service
