#include "service/peer.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/server_posix.h"

namespace eps::service {

std::string Peer::Describe() const {
  return known ? absl::StrCat("uid ", uid, " (pid ", pid, ")") : "an unknown peer";
}

std::optional<uid_t> ShmOwnerFor(const Peer& caller) {
  if (!caller.known) return geteuid();
  if (caller.uid == 0) return std::nullopt;
  return caller.uid;
}

void PeerTable::Set(int fd, const Peer& peer) {
  absl::MutexLock lock(&mu_);
  by_fd_[fd] = peer;  // a reused descriptor: its old connection is closed, this one replaces it
}

Peer PeerTable::Lookup(std::string_view grpc_peer) const {
  int fd = -1;
  if (grpc_peer.substr(0, 3) != "fd:" ||
      !absl::SimpleAtoi(absl::string_view(grpc_peer.data() + 3, grpc_peer.size() - 3), &fd))
    return {};
  absl::MutexLock lock(&mu_);
  const auto it = by_fd_.find(fd);
  return it == by_fd_.end() ? Peer{} : it->second;
}

absl::StatusOr<std::unique_ptr<UnixAcceptor>> UnixAcceptor::Start(int listen_fd,
                                                                  grpc::Server& server,
                                                                  PeerTable& peers) {
  auto acceptor = std::unique_ptr<UnixAcceptor>(new UnixAcceptor());
  acceptor->listen_fd_ = listen_fd;
  acceptor->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (acceptor->wake_fd_ < 0) {
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  UnixAcceptor* raw = acceptor.get();
  acceptor->thread_ = std::thread([raw, &server, &peers] { raw->Loop(server, peers); });
  return acceptor;
}

void UnixAcceptor::Loop(grpc::Server& server, PeerTable& peers) {
  pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  // Out of descriptors, accept fails until some are closed: said once a minute (with
  // the count since), not a hundred times a second.
  std::chrono::steady_clock::time_point said{};
  uint64_t unsaid = 0;
  for (;;) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      std::fprintf(stderr, "epsd: poll on the Unix socket: %s\n", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;  // Stop()
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED) {
        const int err = errno;
        const auto now = std::chrono::steady_clock::now();
        if (now - said >= std::chrono::minutes(1)) {
          std::fprintf(stderr,
                       "epsd: accept on the Unix socket: %s (%llu more since the last "
                       "report)\n",
                       std::strerror(err), static_cast<unsigned long long>(unsaid));
          said = now;
          unsaid = 0;
        } else {
          ++unsaid;
        }
        if (err == EMFILE || err == ENFILE) usleep(10000);  // let descriptors free up
      }
      continue;
    }
    ucred credentials{};
    socklen_t length = sizeof(credentials);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
      close(fd);  // a peer without credentials is not served on the Unix socket
      continue;
    }
    // Recorded before gRPC sees the connection: no call on it can come first.
    peers.Set(fd, {.known = true, .uid = credentials.uid, .pid = credentials.pid});
    grpc::AddInsecureChannelFromFd(&server, fd);
  }
}

void UnixAcceptor::Stop() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
}

UnixAcceptor::~UnixAcceptor() {
  Stop();
  if (wake_fd_ >= 0) close(wake_fd_);
}

}  // namespace eps::service
