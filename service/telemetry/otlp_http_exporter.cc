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

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
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

struct HttpResponse {
  int code = 0;      // the status; 0: no response
  std::string body;  // what arrived of the body (it may be cut: the status decides)
};

// The value of header `name` (lower case) in `head`, empty when absent.
std::string HeaderValue(const std::string& head, const std::string& name) {
  const std::string lower = absl::AsciiStrToLower(head);
  const size_t at = lower.find("\r\n" + name + ":");
  if (at == std::string::npos) return "";
  const size_t start = at + 2 + name.size() + 1;
  const size_t end = head.find("\r\n", start);
  return std::string(absl::StripAsciiWhitespace(head.substr(start, end - start)));
}

// A chunked body (RFC 9112 section 7.1) decoded into `out`, as far as it goes; true once
// its last chunk is in (or it cannot be decoded further: no more is worth waiting for).
bool Dechunk(const std::string& in, std::string* out) {
  out->clear();
  size_t at = 0;
  for (;;) {
    const size_t line_end = in.find("\r\n", at);
    if (line_end == std::string::npos) return false;
    size_t size = 0;
    const std::string size_text = in.substr(at, in.find_first_of(";\r", at) - at);
    if (!absl::SimpleHexAtoi(size_text, &size) || size == 0) return true;
    at = line_end + 2;
    if (size > in.size() - at) return false;
    out->append(in, at, size);
    at += size + 2;
  }
}

// Reads the status line and headers, then a 2xx reply's body until Content-Length bytes, its
// last chunk, the end of the connection (we send Connection: close) or 64 KiB; returns code 0
// with `error` set when no status arrived. The body is read in the same deadline, and a reply that
// stops short of it keeps its status: the status decides success, the body only adds the partial
// success.
HttpResponse ReadResponse(int fd, const Attempt& attempt, std::string* error) {
  constexpr size_t kMaxResponse = 65536;
  HttpResponse response;
  std::string in;
  char buffer[4096];
  size_t head_end = std::string::npos;
  size_t want = kMaxResponse;  // all the bytes to read: the head, then the body
  bool chunked = false;
  while (in.size() < want) {
    if (const Wait waited = WaitFor(fd, POLLIN, attempt); waited != Wait::kReady) {
      if (head_end != std::string::npos) break;  // the status is in: keep it
      *error = waited == Wait::kCancelled ? kCancelled : "no HTTP response before the timeout";
      return response;
    }
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      if (head_end != std::string::npos) break;
      *error = absl::StrCat("recv: ", std::strerror(errno));
      return response;
    }
    in.append(buffer, static_cast<size_t>(n));
    if (head_end == std::string::npos && (head_end = in.find("\r\n\r\n")) != std::string::npos) {
      const std::string head = in.substr(0, head_end);
      size_t length = 0;
      if (!absl::StartsWith(head, "HTTP/1.1 2") && !absl::StartsWith(head, "HTTP/1.0 2")) {
        break;  // a failure: its status is all we use, so wait for no body
      }
      if (absl::SimpleAtoi(HeaderValue(head, "content-length"), &length)) {
        want = std::min(kMaxResponse, head_end + 4 + length);
      }
      chunked = absl::StrContains(absl::AsciiStrToLower(HeaderValue(head, "transfer-encoding")),
                                  "chunked");
    }
    // A chunked body ends with its last chunk, whether or not the connection does.
    if (chunked && Dechunk(in.substr(head_end + 4), &response.body)) break;
  }
  // "HTTP/1.1 200 OK"
  const size_t space = in.find(' ');
  if (in.rfind("HTTP/1.", 0) != 0 || space == std::string::npos ||
      !absl::SimpleAtoi(in.substr(space + 1, 3), &response.code)) {
    *error = absl::StrCat("not an HTTP response: '", absl::CHexEscape(in.substr(0, 40)), "'");
    response.code = 0;
    return response;
  }
  if (response.code / 100 != 2) *error = in.substr(0, std::min(in.find("\r\n"), size_t{200}));
  if (head_end != std::string::npos) {
    const std::string body = in.substr(std::min(in.size(), head_end + 4));
    if (chunked) {
      Dechunk(body, &response.body);
    } else {
      response.body = body;
    }
  }
  return response;
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

ExportOutcome OtlpHttpExporter::Export(
    const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
    Clock::time_point deadline) {
  ExportOutcome outcome = TryOnce(request, deadline);
  // However the attempt ended, a cancelled one is not retried.
  if (outcome.result != ExportResult::kSuccess && cancelled_.load()) {
    return ExportOutcome::Failure(ExportResult::kFailed, kCancelled);
  }
  return outcome;
}

ExportOutcome OtlpHttpExporter::TryOnce(
    const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
    Clock::time_point deadline) {
  if (cancelled_.load()) return ExportOutcome::Failure(ExportResult::kFailed, kCancelled);
  const Attempt attempt{deadline, cancel_fd_};
  const std::string body = request.SerializeAsString();
  std::string error;
  const int fd = Connect(config_.endpoint, attempt, &error);
  // Refused, unreachable or slow: try later.
  if (fd < 0) return ExportOutcome::Failure(ExportResult::kRetryable, std::move(error));
  Socket socket(fd);
  std::string head = absl::StrCat(
      "POST ", config_.endpoint.path, " HTTP/1.1\r\nHost: ", config_.endpoint.authority(),
      "\r\nContent-Type: application/x-protobuf\r\nContent-Length: ", body.size(),
      "\r\nConnection: close\r\n");
  for (const auto& [key, value] : config_.headers) absl::StrAppend(&head, key, ": ", value, "\r\n");
  absl::StrAppend(&head, "\r\n");
  if (!SendAll(fd, head + body, attempt, &error)) {
    return ExportOutcome::Failure(ExportResult::kRetryable, std::move(error));
  }
  const HttpResponse response = ReadResponse(fd, attempt, &error);
  if (response.code / 100 == 2) {
    // OTLP/HTTP answers an ExportTraceServiceResponse: its partial_success says which spans
    // the receiver refused. An empty or unreadable body refused none.
    opentelemetry::proto::collector::trace::v1::ExportTraceServiceResponse reply;
    if (response.body.empty() || !reply.ParseFromString(response.body)) reply.Clear();
    return ExportOutcome::Success(CountSpans(request), reply.partial_success().rejected_spans(),
                                  reply.partial_success().error_message());
  }
  // OTLP/HTTP: 429, 502, 503 and 504 are retryable, any other status is not.
  const int code = response.code;
  const bool retryable = code == 0 || code == 429 || code == 502 || code == 503 || code == 504;
  return ExportOutcome::Failure(retryable ? ExportResult::kRetryable : ExportResult::kFailed,
                                std::move(error));
}

std::string OtlpHttpExporter::Describe() const {
  return absl::StrCat("otlp/http http://", config_.endpoint.authority(), config_.endpoint.path);
}

}  // namespace eps::telemetry
