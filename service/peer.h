// Who is on the other end of a call: on the Unix socket, the user and process
// that connected, from the kernel (SO_PEERCRED); over TCP, unknown. epsd
// accepts Unix connections itself (UnixAcceptor), records each one's
// credentials by file descriptor, then hands the connection to gRPC, whose
// calls name it as "fd:N" (grpc::ServerContext::peer()). Sessions are bound to
// the user that attached them (docs/security.md).
//
// Thread safety: PeerTable may be used from any thread. UnixAcceptor's Start
// and Stop are called by the server's owner, once each.
#pragma once

#include <sys/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/server.h"

namespace eps::service {

struct Peer {
  bool known = false;  // false: TCP, or an in-process caller
  uid_t uid = 0;
  pid_t pid = 0;
  std::string Describe() const;  // "uid 1000 (pid 4242)" or "an unknown peer"
};

// The user whose host_shm objects a caller may name: its own (any user's for root);
// for a caller of unknown credentials (TCP, an in-process caller) epsd's own user
// only, so that no caller reaches through epsd an object it could not open itself
// (docs/security.md). nullopt: any user's.
std::optional<uid_t> ShmOwnerFor(const Peer& caller);

class PeerTable {
 public:
  void Set(int fd, const Peer& peer);
  // The credentials of the connection gRPC names `grpc_peer` ("fd:N"); unknown otherwise.
  Peer Lookup(std::string_view grpc_peer) const;

 private:
  mutable absl::Mutex mu_;
  std::map<int, Peer> by_fd_ ABSL_GUARDED_BY(mu_);
};

// Accepts on a listening Unix socket and gives every connection, with its
// credentials recorded in `peers`, to a running gRPC server.
class UnixAcceptor {
 public:
  // Starts accepting on `listen_fd` (non-blocking, listening; borrowed: it must outlive
  // the acceptor, which ListeningUnixSocket in service/unix_socket.h provides).
  static absl::StatusOr<std::unique_ptr<UnixAcceptor>> Start(int listen_fd, grpc::Server& server,
                                                             PeerTable& peers);
  ~UnixAcceptor();  // Stop()
  // Stops accepting new connections (those accepted stay with gRPC).
  void Stop();

 private:
  UnixAcceptor() = default;
  void Loop(grpc::Server& server, PeerTable& peers);

  int listen_fd_ = -1;  // borrowed
  int wake_fd_ = -1;    // eventfd: Stop() wakes the loop's poll
  std::thread thread_;
};

}  // namespace eps::service
