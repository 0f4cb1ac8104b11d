#include "service/unix_socket.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace eps::service {
namespace {

// The address of `path`, which the caller has checked fits sun_path.
sockaddr_un AddressOf(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  return address;
}

// An exclusive flock on path + ".lock", held while it lives. The lock file is created
// if need be and never removed: removing it would let two epsds lock two different files.
class PathLock {
 public:
  static absl::StatusOr<PathLock> Acquire(const std::string& path) {
    const std::string lock_path = path + ".lock";
    // Read-only is enough for flock, and lets the lock file of another user be shared.
    PathLock lock(open(lock_path.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
    if (lock.fd_ < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot open the lock file ", lock_path, ": ", std::strerror(errno)));
    }
    int rc;
    do {
      rc = flock(lock.fd_, LOCK_EX);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot lock ", lock_path, ": ", std::strerror(errno)));
    }
    return lock;
  }
  PathLock(PathLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  PathLock& operator=(PathLock&&) = delete;
  ~PathLock() {
    if (fd_ >= 0) close(fd_);  // releases the flock
  }

 private:
  explicit PathLock(int fd) : fd_(fd) {}
  int fd_;
};

// Makes `path` free to bind: nothing there, or a dead server's socket, which is removed.
// Called under the path's lock.
absl::Status ClearStaleSocket(const std::string& path) {
  struct stat info {};
  if (lstat(path.c_str(), &info) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat("cannot inspect ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISSOCK(info.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " exists and is not a socket; not removing it (remove it, or choose another path)"));
  }
  // Non-blocking: a live server whose backlog is full (or that stopped accepting while it
  // shuts down) answers EAGAIN at once instead of holding this start, and the lock, forever.
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  const sockaddr_un address = AddressOf(path);
  const int rc = connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address));
  const int err = errno;
  close(fd);
  if (rc == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("another server is listening on ", path, "; not taking it over"));
  }
  // Only a refused connection says that nobody listens: any other error (EACCES, say)
  // leaves it unknown, and the socket may be a live server's.
  if (err != ECONNREFUSED) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot tell whether a server is listening on ", path,
                     " (connect: ", std::strerror(err), "); not taking it over"));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot remove the stale socket ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ListeningUnixSocket>> ListeningUnixSocket::Bind(
    const std::string& path, uint32_t mode) {
  if (path.empty() || path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("--listen=unix://", path,
                                                   ": want a path of 1 to ",
                                                   sizeof(sockaddr_un::sun_path) - 1, " bytes"));
  }
  auto socket_file = std::unique_ptr<ListeningUnixSocket>(new ListeningUnixSocket(path));
  absl::StatusOr<PathLock> lock = PathLock::Acquire(path);
  if (!lock.ok()) return lock.status();
  if (absl::Status s = ClearStaleSocket(path); !s.ok()) return s;
  socket_file->fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (socket_file->fd_ < 0) {
    return absl::InternalError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  }
  const sockaddr_un address = AddressOf(path);
  if (bind(socket_file->fd_, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    // The path was cleared under the lock: something other than an epsd made it since.
    if (errno == EADDRINUSE) {
      return absl::FailedPreconditionError(
          absl::StrCat("another server is listening on ", path, "; not taking it over"));
    }
    return absl::UnavailableError(absl::StrCat("bind ", path, ": ", std::strerror(errno)));
  }
  struct stat info {};
  if (lstat(path.c_str(), &info) != 0) {
    return absl::InternalError(absl::StrCat("lstat ", path, ": ", std::strerror(errno)));
  }
  socket_file->bound_ = true;
  socket_file->device_ = info.st_dev;
  socket_file->inode_ = info.st_ino;
  if (chmod(path.c_str(), mode) != 0) {
    return absl::InternalError(absl::StrCat("chmod ", path, ": ", std::strerror(errno)));
  }
  if (listen(socket_file->fd_, SOMAXCONN) != 0) {
    return absl::UnavailableError(absl::StrCat("listen ", path, ": ", std::strerror(errno)));
  }
  return socket_file;
}

ListeningUnixSocket::~ListeningUnixSocket() {
  if (bound_) {
    // Under the lock: an epsd starting now waits until the file is gone, and then binds a
    // new one that this check cannot mistake for ours. Without the lock (it could not be
    // taken) the inode check alone still keeps another server's socket.
    const absl::StatusOr<PathLock> lock = PathLock::Acquire(path_);
    struct stat info {};
    if (lstat(path_.c_str(), &info) == 0 && S_ISSOCK(info.st_mode) && info.st_dev == device_ &&
        info.st_ino == inode_) {
      unlink(path_.c_str());
    }
  }
  if (fd_ >= 0) close(fd_);
}

}  // namespace eps::service
