// The /metrics HTTP listener under slow or idle clients (docs/observability.md): a
// connection that sends nothing, or half a request, must not hold up other scrapes.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "service/telemetry/metrics.h"

namespace eps::telemetry {
namespace {

using Clock = std::chrono::steady_clock;

// An open TCP connection to 127.0.0.1:port, closed on destruction.
class Connection {
 public:
  explicit Connection(int port) : fd_(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ =
        fd_ >= 0 && connect(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  }
  ~Connection() {
    if (fd_ >= 0) close(fd_);
  }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  bool connected() const { return connected_; }
  int fd() const { return fd_; }
  bool Send(const std::string& text) {
    return send(fd_, text.data(), text.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(text.size());
  }
  // Everything the server sends until it closes, or until `deadline`.
  std::string ReadUntilClosed(Clock::time_point deadline) {
    std::string out;
    char chunk[4096];
    while (true) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) break;
      pollfd p{.fd = fd_, .events = POLLIN, .revents = 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) break;
      const ssize_t n = recv(fd_, chunk, sizeof(chunk), 0);
      if (n <= 0) break;
      out.append(chunk, static_cast<size_t>(n));
    }
    return out;
  }

 private:
  int fd_;
  bool connected_ = false;
};

constexpr auto kScrapeBound = std::chrono::seconds(3);

TEST(MetricsHttpTest, AnIdleAndAHalfSentConnectionDoNotBlockAScrape) {
  ServerMetrics metrics({});
  ASSERT_TRUE(metrics.Serve("127.0.0.1:0").ok());
  Connection idle(metrics.port());
  Connection half_sent(metrics.port());
  ASSERT_TRUE(idle.connected() && half_sent.connected());
  ASSERT_TRUE(half_sent.Send("GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"));

  const Clock::time_point start = Clock::now();
  Connection scrape(metrics.port());
  ASSERT_TRUE(scrape.connected());
  ASSERT_TRUE(scrape.Send("GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"));
  const std::string reply = scrape.ReadUntilClosed(start + kScrapeBound);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();

  EXPECT_EQ(reply.rfind("HTTP/1.1 200", 0), 0u) << "after " << seconds << " s: " << reply;
  EXPECT_NE(reply.find("grpc_server_started_total"), std::string::npos);
  EXPECT_LT(seconds, std::chrono::duration<double>(kScrapeBound).count());
}

// With 4 threads, 16 silent connections made a scrape wait for four rounds of the 2 s
// request timeout, each closing 4 of them (64 such connections, reconnecting, held scrapes
// for 31 s). The scrape must now be answered while all of them are still open: no idle
// connection's close comes before the reply. (An order of events, not a time.)
TEST(MetricsHttpTest, AScrapeIsAnsweredWhileSixteenIdleConnectionsAreStillOpen) {
  ServerMetrics metrics({});
  ASSERT_TRUE(metrics.Serve("127.0.0.1:0").ok());
  constexpr int kIdle = 16;
  std::vector<std::unique_ptr<Connection>> idle;
  for (int i = 0; i < kIdle; ++i) {
    idle.push_back(std::make_unique<Connection>(metrics.port()));
    ASSERT_TRUE(idle.back()->connected());
  }
  Connection scrape(metrics.port());
  ASSERT_TRUE(scrape.connected());
  ASSERT_TRUE(scrape.Send("GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"));
  // Wait for the first event on any of the connections: the reply, or a close.
  std::vector<pollfd> fds;
  fds.push_back({.fd = scrape.fd(), .events = POLLIN, .revents = 0});
  for (const auto& c : idle) fds.push_back({.fd = c->fd(), .events = POLLIN, .revents = 0});
  ASSERT_GT(poll(fds.data(), fds.size(), 30000), 0) << "nothing happened in 30 s";
  int closed = 0;
  for (size_t i = 1; i < fds.size(); ++i) closed += fds[i].revents != 0;
  EXPECT_NE(fds[0].revents, 0) << "the scrape was not answered first";
  EXPECT_EQ(closed, 0) << closed << " idle connections were closed before the scrape's reply";
  const std::string reply = scrape.ReadUntilClosed(Clock::now() + std::chrono::seconds(30));
  EXPECT_EQ(reply.rfind("HTTP/1.1 200", 0), 0u) << reply;
}

TEST(MetricsHttpTest, MoreIdleConnectionsThanThreadsAreDroppedWithinTheRequestTimeout) {
  ServerMetrics metrics({});
  ASSERT_TRUE(metrics.Serve("127.0.0.1:0").ok());
  // More silent connections than the listener has threads: each must be closed by the
  // server after its request timeout, freeing its thread for the scrape that follows.
  constexpr int kIdle = 2 * ServerMetrics::kHttpThreads;
  std::vector<std::unique_ptr<Connection>> idle;
  for (int i = 0; i < kIdle; ++i) {
    idle.push_back(std::make_unique<Connection>(metrics.port()));
    ASSERT_TRUE(idle.back()->connected());
  }
  const Clock::time_point start = Clock::now();
  Connection scrape(metrics.port());
  ASSERT_TRUE(scrape.connected());
  ASSERT_TRUE(scrape.Send("GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"));
  // The silent clients hold the listener's threads for a few request timeouts at most.
  const auto bound = std::chrono::seconds(15);
  const std::string reply = scrape.ReadUntilClosed(start + bound);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(reply.rfind("HTTP/1.1 200", 0), 0u) << "after " << seconds << " s: " << reply;
}

}  // namespace
}  // namespace eps::telemetry
