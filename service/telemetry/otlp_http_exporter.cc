#include "service/telemetry/otlp_http_exporter.h"

#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace eps::telemetry {
namespace {

using Clock = std::chrono::steady_clock;

int MillisLeft(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left.count(), INT32_MAX));
}

// A socket closed on every path out.
class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

// What bounds one attempt: its deadline, and the exporter's cancellation (an eventfd that
// turns readable for good).
struct Attempt {
  Clock::time_point deadline;
  int cancel_fd;
};

enum class Wait { kReady, kTimedOut, kCancelled };

// Waits until `fd` has `events`, the deadline passes or the attempt is cancelled.
Wait WaitFor(int fd, short events, const Attempt& attempt) {
  pollfd p[2] = {{fd, events, 0}, {attempt.cancel_fd, POLLIN, 0}};  // poll skips fd -1
  for (;;) {
    const int rc = poll(p, 2, MillisLeft(attempt.deadline));
    if (rc > 0) return p[1].revents != 0 ? Wait::kCancelled : Wait::kReady;
    if (rc == 0 || errno != EINTR) return Wait::kTimedOut;
  }
}

const char* kCancelled = "cancelled: epsd is stopping";

using AddressList = std::unique_ptr<addrinfo, decltype(&freeaddrinfo)>;

// getaddrinfo has no timeout: a resolver that does not answer holds it for the
// resolver's own timeouts (5 s per server and attempt by default), past the export's
// deadline and Shutdown's budget. A numeric host resolves at once, in place; a name is
// resolved on a thread of its own, waited for (an eventfd it signals, polled beside the
// cancellation) until the deadline. A late answer lands in the shared state, freed by
// whichever side lets go of it last. Each export to a name starts one such thread; with a
// resolver that never answers, at most (the resolver's timeout ÷ the exports' interval) of
// them are alive at once, each ending with getaddrinfo.
AddressList Resolve(const OtlpEndpoint& e, const Attempt& attempt, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string port = std::to_string(e.port);
  addrinfo* found = nullptr;
  hints.ai_flags = AI_NUMERICHOST;
  if (getaddrinfo(e.host.c_str(), port.c_str(), &hints, &found) == 0) {
    return AddressList(found, &freeaddrinfo);
  }
  hints.ai_flags = 0;
  struct Lookup {
    Lookup() : done(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}
    ~Lookup() {
      if (done >= 0) close(done);
    }
    std::mutex mu;
    const int done;  // readable once the answer is in
    int rc = 0;
    AddressList found{nullptr, &freeaddrinfo};
  };
  auto lookup = std::make_shared<Lookup>();
  if (lookup->done < 0) {
    *error = absl::StrCat("resolve ", e.host, ": eventfd: ", std::strerror(errno));
    return AddressList(nullptr, &freeaddrinfo);
  }
  std::thread([lookup, host = e.host, port, hints] {
    addrinfo* result = nullptr;
    const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &result);
    std::lock_guard lock(lookup->mu);
    lookup->rc = rc;
    lookup->found.reset(result);
    const uint64_t one = 1;
    (void)!write(lookup->done, &one, sizeof(one));
  }).detach();
  const Wait waited = WaitFor(lookup->done, POLLIN, attempt);
  if (waited != Wait::kReady) {
    *error = waited == Wait::kCancelled
                 ? std::string(kCancelled)
                 : absl::StrCat("resolve ", e.host, ": no answer before the deadline");
    return AddressList(nullptr, &freeaddrinfo);
  }
  std::lock_guard lock(lookup->mu);
  if (lookup->rc != 0) *error = absl::StrCat("resolve ", e.host, ": ", gai_strerror(lookup->rc));
  return std::move(lookup->found);
}

// Connects without blocking past the deadline; -1 with `error` set on failure.
int Connect(const OtlpEndpoint& e, const Attempt& attempt, std::string* error) {
  const AddressList addresses = Resolve(e, attempt, error);
  if (addresses == nullptr) return -1;
  addrinfo* found = addresses.get();
  int connected = -1;
  for (addrinfo* a = found; a != nullptr && connected < 0; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const bool at_once = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    const int connect_errno = errno;
    const Wait waited = at_once                        ? Wait::kReady
                        : connect_errno == EINPROGRESS ? WaitFor(fd, POLLOUT, attempt)
                                                       : Wait::kTimedOut;
    if (waited == Wait::kReady) {
      int so_error = 0;
      socklen_t len = sizeof(so_error);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
      if (so_error == 0) {
        connected = fd;
        break;
      }
      *error = absl::StrCat("connect ", e.host, ":", e.port, ": ", std::strerror(so_error));
    } else if (waited == Wait::kCancelled) {
      *error = kCancelled;
      close(fd);
      return -1;
    } else {
      *error =
          absl::StrCat("connect ", e.host, ":", e.port, ": ",
                       connect_errno == EINPROGRESS ? "timed out" : std::strerror(connect_errno));
    }
    close(fd);
  }
  return connected;
}

bool SendAll(int fd, const std::string& bytes, const Attempt& attempt, std::string* error) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
    } else if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (const Wait waited = WaitFor(fd, POLLOUT, attempt); waited != Wait::kReady) {
        *error = waited == Wait::kCancelled ? kCancelled : "send timed out";
        return false;
      }
    } else {
      *error = absl::StrCat("send: ", std::strerror(errno));
      return false;
    }
  }
  return true;
}

// Reads until the status line and headers are in (the body is not needed: the
// status decides success); returns the status code, 0 on failure.
int ReadStatus(int fd, const Attempt& attempt, std::string* error) {
  std::string in;
  char buffer[4096];
  while (in.find("\r\n\r\n") == std::string::npos && in.size() < 65536) {
    if (const Wait waited = WaitFor(fd, POLLIN, attempt); waited != Wait::kReady) {
      *error = waited == Wait::kCancelled ? kCancelled : "no HTTP response before the timeout";
      return 0;
    }
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      *error = absl::StrCat("recv: ", std::strerror(errno));
      return 0;
    }
    in.append(buffer, static_cast<size_t>(n));
  }
  // "HTTP/1.1 200 OK"
  int code = 0;
  const size_t space = in.find(' ');
  if (in.rfind("HTTP/1.", 0) != 0 || space == std::string::npos ||
      !absl::SimpleAtoi(in.substr(space + 1, 3), &code)) {
    *error = absl::StrCat("not an HTTP response: '", in.substr(0, 40), "'");
    return 0;
  }
  if (code / 100 != 2) *error = in.substr(0, in.find("\r\n"));
  return code;
}

}  // namespace

OtlpHttpExporter::OtlpHttpExporter(const TraceConfig& config)
    : config_(config), cancel_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

OtlpHttpExporter::~OtlpHttpExporter() {
  if (cancel_fd_ >= 0) close(cancel_fd_);
}

void OtlpHttpExporter::Cancel() {
  cancelled_.store(true);
  const uint64_t one = 1;
  if (cancel_fd_ >= 0) (void)!write(cancel_fd_, &one, sizeof(one));
}

ExportResult OtlpHttpExporter::Export(
    const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
    Clock::time_point deadline, std::string* error) {
  const ExportResult result = TryOnce(request, deadline, error);
  // However the attempt ended, a cancelled one is not retried.
  if (result != ExportResult::kSuccess && cancelled_.load()) {
    *error = kCancelled;
    return ExportResult::kFailed;
  }
  return result;
}

ExportResult OtlpHttpExporter::TryOnce(
    const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
    Clock::time_point deadline, std::string* error) {
  if (cancelled_.load()) return ExportResult::kFailed;
  const Attempt attempt{deadline, cancel_fd_};
  const std::string body = request.SerializeAsString();
  const int fd = Connect(config_.endpoint, attempt, error);
  if (fd < 0) return ExportResult::kRetryable;  // refused, unreachable or slow: try later
  Socket socket(fd);
  std::string head =
      absl::StrCat("POST ", config_.endpoint.path, " HTTP/1.1\r\nHost: ", config_.endpoint.host,
                   ":", config_.endpoint.port,
                   "\r\nContent-Type: application/x-protobuf\r\nContent-Length: ", body.size(),
                   "\r\nConnection: close\r\n");
  for (const auto& [key, value] : config_.headers) absl::StrAppend(&head, key, ": ", value, "\r\n");
  absl::StrAppend(&head, "\r\n");
  if (!SendAll(fd, head + body, attempt, error)) return ExportResult::kRetryable;
  const int code = ReadStatus(fd, attempt, error);
  if (code / 100 == 2) return ExportResult::kSuccess;
  // OTLP/HTTP: 429, 502, 503 and 504 are retryable, any other status is not.
  if (code == 0 || code == 429 || code == 502 || code == 503 || code == 504) {
    return ExportResult::kRetryable;
  }
  return ExportResult::kFailed;
}

std::string OtlpHttpExporter::Describe() const {
  return absl::StrCat("otlp/http http://", config_.endpoint.host, ":", config_.endpoint.port,
                      config_.endpoint.path);
}

}  // namespace eps::telemetry
