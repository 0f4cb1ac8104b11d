// StopWhileWaking (service/telemetry/listener_wake.h): while the stop runs, its listener is
// connected to, so that a server that looks at its stop flag only between polls of that
// listener sees it at once.
#include "service/telemetry/listener_wake.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <optional>
#include <string>

#include "gtest/gtest.h"

namespace eps::telemetry {
namespace {

// A TCP listener on 127.0.0.1 and a port the kernel picks, closed on destruction.
class Listener {
 public:
  Listener() : fd_(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof(address);
    if (fd_ < 0 || bind(fd_, reinterpret_cast<sockaddr*>(&address), size) != 0 ||
        listen(fd_, 16) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &size) != 0) {
      return;
    }
    port_ = ntohs(address.sin_port);
  }
  ~Listener() {
    if (fd_ >= 0) close(fd_);
  }
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  int port() const { return port_; }
  // Whether a connection comes within `ms` (as the stopping server's poll would see it).
  bool ConnectionWithin(int ms) const {
    pollfd p{fd_, POLLIN, 0};
    return poll(&p, 1, ms) == 1 && (p.revents & POLLIN) != 0;
  }

 private:
  int fd_;
  int port_ = 0;
};

TEST(StopWhileWaking, TheListenerIsConnectedToWhileTheStopRuns) {
  for (const std::string host : {"127.0.0.1", "0.0.0.0", "", "localhost"}) {
    Listener listener;
    ASSERT_GT(listener.port(), 0);
    const std::optional<sockaddr_in> address = ListenerAddress(host, listener.port());
    ASSERT_TRUE(address.has_value()) << "host '" << host << "'";
    bool woken = false;
    int stops = 0;
    // The stop waits for the wake (10 s bounds a failure, not a time measured).
    StopWhileWaking(address, [&] {
      ++stops;
      woken = listener.ConnectionWithin(10'000);
    });
    EXPECT_TRUE(woken) << "host '" << host << "'";
    EXPECT_EQ(stops, 1);
  }
}

TEST(ListenerAddress, IsIpv4LoopbackForEveryInterfaceAndNoneWithoutAPortOrAnIpv4Host) {
  for (const std::string host : {"0.0.0.0", ""}) {
    const std::optional<sockaddr_in> a = ListenerAddress(host, 9464);
    ASSERT_TRUE(a.has_value()) << "host '" << host << "'";
    EXPECT_EQ(a->sin_family, AF_INET);
    EXPECT_EQ(ntohl(a->sin_addr.s_addr), INADDR_LOOPBACK);
    EXPECT_EQ(ntohs(a->sin_port), 9464);
  }
  EXPECT_FALSE(ListenerAddress("127.0.0.1", 0).has_value());  // not serving
  EXPECT_FALSE(ListenerAddress("::1", 9464).has_value());     // IPv6: never resolved to IPv4
  int stops = 0;
  StopWhileWaking(std::nullopt, [&] { ++stops; });  // nothing to wake: the stop alone
  EXPECT_EQ(stops, 1);
}

TEST(StopWhileWaking, APortNothingListensOnDoesNotHoldTheStop) {
  int port = 0;
  {
    Listener gone;  // closed at the end of this scope: connections are then refused at once
    port = gone.port();
  }
  ASSERT_GT(port, 0);
  int stops = 0;
  StopWhileWaking(ListenerAddress("127.0.0.1", port), [&] { ++stops; });
  EXPECT_EQ(stops, 1);
}

}  // namespace
}  // namespace eps::telemetry
