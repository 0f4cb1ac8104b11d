#include "load/process_stats.h"

#include <dirent.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace eps::load {
namespace {

// Names of the entries of directory `path` (without . and ..).
absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) {
  DIR* dir = opendir(path.c_str());
  if (dir == nullptr) {
    return absl::NotFoundError(absl::StrCat("opendir ", path, ": ", std::strerror(errno)));
  }
  std::vector<std::string> names;
  while (dirent* e = readdir(dir)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
      names.emplace_back(e->d_name);
    }
  }
  closedir(dir);
  return names;
}

// `path` with runs of '/' collapsed: gRPC binds "unix:///tmp/x" as "///tmp/x".
std::string CollapseSlashes(const std::string& path) {
  std::string out;
  for (char c : path) {
    if (c != '/' || out.empty() || out.back() != '/') out += c;
  }
  return out;
}

// Inodes of the listening sockets bound to `path` (/proc/net/unix: the path is
// the last column; flag 00010000 is __SO_ACCEPTCON, a listening socket).
std::set<std::string> UnixListenInodes(const std::string& path) {
  std::set<std::string> inodes;
  std::ifstream in("/proc/net/unix");
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    const std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.size() >= 8 && f[3] == "00010000" && CollapseSlashes(f[7]) == CollapseSlashes(path)) {
      inodes.insert(f[6]);
    }
  }
  return inodes;
}

// Inodes of TCP sockets listening on `port` (state 0A) in /proc/net/tcp and tcp6.
std::set<std::string> TcpListenInodes(int port) {
  std::set<std::string> inodes;
  char hex_port[8];
  std::snprintf(hex_port, sizeof(hex_port), "%04X", port);
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      const std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() < 10 || f[3] != "0A") continue;
      if (absl::EndsWith(f[1], absl::StrCat(":", hex_port))) inodes.insert(f[9]);
    }
  }
  return inodes;
}

}  // namespace

absl::StatusOr<ProcessStats> ReadProcessStats(pid_t pid) {
  const std::string dir = absl::StrCat("/proc/", pid);
  std::ifstream status(dir + "/status");
  if (!status) return absl::NotFoundError(absl::StrCat(dir, "/status is not readable"));
  ProcessStats s;
  std::string line;
  bool have_rss = false;
  while (std::getline(status, line)) {
    std::vector<std::string> f = absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (f.size() < 2) continue;
    if (f[0] == "VmRSS:") have_rss = absl::SimpleAtoi(f[1], &s.rss_kb);
    if (f[0] == "Threads:") (void)absl::SimpleAtoi(f[1], &s.threads);
  }
  if (!have_rss) return absl::NotFoundError(absl::StrCat(dir, "/status has no VmRSS (exited?)"));
  auto fds = ListDir(dir + "/fd");
  if (!fds.ok()) return fds.status();
  s.open_fds = static_cast<int64_t>(fds->size());
  return s;
}

absl::StatusOr<pid_t> FindListeningProcess(const std::string& target) {
  std::set<std::string> inodes;
  if (absl::StartsWith(target, "unix://")) {
    inodes = UnixListenInodes(target.substr(7));
  } else {
    const size_t colon = target.rfind(':');
    int port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(target.substr(colon + 1), &port)) {
      return absl::InvalidArgumentError(absl::StrCat("cannot take a port from ", target));
    }
    inodes = TcpListenInodes(port);
  }
  if (inodes.empty()) {
    return absl::NotFoundError(absl::StrCat("no listening socket for ", target));
  }
  auto procs = ListDir("/proc");
  if (!procs.ok()) return procs.status();
  for (const std::string& name : *procs) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(name, &pid) || pid == getpid()) continue;
    auto fds = ListDir(absl::StrCat("/proc/", pid, "/fd"));
    if (!fds.ok()) continue;  // another user's process, or gone
    for (const std::string& fd : *fds) {
      char link[128];
      const ssize_t n =
          readlink(absl::StrCat("/proc/", pid, "/fd/", fd).c_str(), link, sizeof(link) - 1);
      if (n <= 0) continue;
      link[n] = '\0';
      absl::string_view v(link);
      if (absl::ConsumePrefix(&v, "socket:[") && absl::ConsumeSuffix(&v, "]") &&
          inodes.count(std::string(v)) > 0) {
        return pid;
      }
    }
  }
  return absl::NotFoundError(absl::StrCat("no readable process holds the socket of ", target));
}

}  // namespace eps::load
