#include "service/telemetry/step_log.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
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

absl::StatusOr<std::unique_ptr<StepLog>> StepLog::Open(const std::string& path, WriteFn write) {
  // O_NONBLOCK: opening a FIFO for writing would wait for a reader (at start, where
  // SIGTERM is blocked); a regular file ignores it.
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NONBLOCK, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--step-log=", path, ": cannot open for appending: ", std::strerror(errno)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat("--step-log=", path, ": not a regular file"));
  }
  if (write == nullptr)
    write = [](int f, const void* data, size_t size) { return ::write(f, data, size); };
  return std::unique_ptr<StepLog>(new StepLog(fd, path, std::move(write)));
}

StepLog::StepLog(int fd, std::string path, WriteFn write)
    : fd_(fd), path_(std::move(path)), write_(std::move(write)) {
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
  if (bytes.empty()) return;
  // A line cut short by an earlier failure (a full disk) is ended first, so that the
  // next line starts on its own and every line stays one JSON object or a cut one.
  const std::string text = mid_line_ ? "\n" + bytes : bytes;
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write_(fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      if (!write_failed_) {  // say it once; the lines are lost, epsd keeps serving
        std::fprintf(stderr, "epsd: --step-log=%s: write failed: %s\n", path_.c_str(),
                     std::strerror(err));
        write_failed_ = true;
      }
      if (done > 0) mid_line_ = text[done - 1] != '\n';  // else as it was
      // The lines whose newline did not reach the file are lost (a cut one too); the
      // leading newline of an earlier cut line is not one of them.
      const size_t lead = text.size() - bytes.size();
      absl::MutexLock lock(&mu_);
      for (size_t i = std::max(done, lead); i < text.size(); ++i) dropped_ += text[i] == '\n';
      return;
    }
    done += static_cast<size_t>(n);
  }
  mid_line_ = false;
}

}  // namespace eps::telemetry
