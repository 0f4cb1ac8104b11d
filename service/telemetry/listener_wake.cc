#include "service/telemetry/listener_wake.h"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <system_error>
#include <thread>

namespace eps::telemetry {

std::optional<sockaddr_in> ListenerAddress(const std::string& host, int port) {
  if (port < 1 || port > 65535) return std::nullopt;
  const std::string name = host.empty() || host == "0.0.0.0" ? "127.0.0.1" : host;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(name.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) {
    return std::nullopt;
  }
  sockaddr_in address{};
  std::memcpy(&address, found->ai_addr, sizeof(address));
  freeaddrinfo(found);
  address.sin_port = htons(static_cast<uint16_t>(port));
  return address;
}

namespace {

// One connection, closed at once; a failure (the listener already gone) is no error.
void Poke(const sockaddr_in& address) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  const timeval bound{0, 100'000};  // a connect that hangs must not hold the stop
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &bound, sizeof(bound));
  connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address));
  close(fd);
}

}  // namespace

void StopWhileWaking(const std::optional<sockaddr_in>& address, absl::FunctionRef<void()> stop) {
  if (!address) {
    stop();
    return;
  }
  std::atomic<bool> stopped{false};
  std::optional<std::thread> waker;
  try {
    waker.emplace([&] {
      while (!stopped.load(std::memory_order_acquire)) {
        Poke(*address);
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
  } catch (const std::system_error&) {  // no thread to spare: the slow stop, not an abort
  }
  stop();
  stopped.store(true, std::memory_order_release);
  if (waker) waker->join();
}

}  // namespace eps::telemetry
