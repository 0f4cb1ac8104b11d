// The Unix socket file epsd listens on (--listen=unix:///path): bound by one epsd at a
// time and removed only by the epsd that bound it.
//
// Before binding, a socket file left at the path by a server that died (one that
// refuses connections) is removed; anything else there is an error: a live server, a
// file that is not a socket, a socket epsd cannot connect to. Two epsds starting on one
// path take turns through an flock on path + ".lock" (created beside it and kept), so
// that check, removal and bind are one step among epsds: the loser sees the winner's
// live socket, never removes it. On exit the socket is removed only when the path still
// names the socket this process bound (same device and inode), under the same lock.
//
// Thread safety: none needed; Bind and the destructor are called by the server's owner.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace eps::service {

class ListeningUnixSocket {
 public:
  // Binds `path`, sets its file mode to `mode` and listens on it.
  static absl::StatusOr<std::unique_ptr<ListeningUnixSocket>> Bind(const std::string& path,
                                                                   uint32_t mode);
  ListeningUnixSocket(const ListeningUnixSocket&) = delete;
  ListeningUnixSocket& operator=(const ListeningUnixSocket&) = delete;
  // Removes the path if it is still this socket, then closes it.
  ~ListeningUnixSocket();

  int fd() const { return fd_; }  // listening, non-blocking; owned
  const std::string& path() const { return path_; }

 private:
  explicit ListeningUnixSocket(std::string path) : path_(std::move(path)) {}

  std::string path_;
  int fd_ = -1;
  bool bound_ = false;  // the file at path_ is ours: remove it on exit
  dev_t device_ = 0;    // what lstat said of path_ right after the bind
  ino_t inode_ = 0;
};

}  // namespace eps::service
