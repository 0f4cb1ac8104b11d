#include "service/telemetry/step_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace eps::telemetry {
namespace {

constexpr size_t kMaxPending = 8u << 20;
constexpr size_t kFlushAt = 256u << 10;

}  // namespace

absl::StatusOr<std::unique_ptr<StepLog>> StepLog::Open(const std::string& path) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--step-log=", path, ": cannot open for appending: ", std::strerror(errno)));
  }
  return std::unique_ptr<StepLog>(new StepLog(fd, path));
}

StepLog::StepLog(int fd, std::string path) : fd_(fd), path_(std::move(path)) {
  writer_ = std::thread([this] { Run(); });
}

StepLog::~StepLog() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  writer_.join();
  close(fd_);
}

void StepLog::Append(const std::string& line) {
  absl::MutexLock lock(&mu_);
  if (pending_.size() + line.size() + 1 > kMaxPending) {
    ++dropped_;
    return;
  }
  pending_.append(line);
  pending_.push_back('\n');
}

uint64_t StepLog::dropped() const {
  absl::MutexLock lock(&mu_);
  return dropped_;
}

void StepLog::Run() {
  for (;;) {
    std::string bytes;
    bool stop = false;
    {
      absl::MutexLock lock(&mu_);
      const auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stopping_ || pending_.size() >= kFlushAt;
      };
      mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(200));
      bytes.swap(pending_);
      stop = stopping_;
    }
    Write(bytes);
    if (stop) return;
  }
}

void StepLog::Write(const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (!write_failed_) {  // say it once; the lines are lost, epsd keeps serving
        std::fprintf(stderr, "epsd: --step-log=%s: write failed: %s\n", path_.c_str(),
                     std::strerror(errno));
        write_failed_ = true;
      }
      absl::MutexLock lock(&mu_);
      for (size_t i = done; i < bytes.size(); ++i) dropped_ += bytes[i] == '\n';
      return;
    }
    done += static_cast<size_t>(n);
  }
}

}  // namespace eps::telemetry
