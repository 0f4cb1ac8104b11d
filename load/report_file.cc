#include "load/report_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace eps::load {

namespace {

absl::Status ErrnoError(const std::string& what, int error) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(error)));
}

}  // namespace

absl::StatusOr<ReportFile> ReportFile::Open(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    if (S_ISDIR(st.st_mode)) return absl::UnavailableError("it is a directory");
    // A link, a device or a FIFO: written through, as a plain open would (no truncation
    // until the report is written).
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return absl::UnavailableError(std::strerror(errno));
    return ReportFile(path, std::string(), fd, /*direct=*/true, /*unnamed=*/false);
  }
  // The pid keeps two runs writing the same report apart; a stale file of the same name is
  // refused rather than written through (it may be a link): O_EXCL below, lstat above.
  std::string temporary = absl::StrCat(path, ".", ::getpid(), ".tmp");
  // First a file with no name in the report's directory (O_TMPFILE), named only at
  // Commit(): a run killed by a signal it does not handle then leaves nothing behind.
  const size_t slash = path.rfind('/');
  const std::string directory =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int unnamed = ::open(directory.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0666);
  if (unnamed >= 0) {
    // What Commit() will need, checked now rather than after the run: the name it links
    // free (a stale file of a dead process with this pid is refused, as O_EXCL refuses it
    // below), and /proc, through which it links.
    struct stat existing {};
    const bool name_taken = ::lstat(temporary.c_str(), &existing) == 0;
    const bool proc = ::access(absl::StrCat("/proc/self/fd/", unnamed).c_str(), F_OK) == 0;
    if (name_taken) {
      ::close(unnamed);
      return absl::UnavailableError(
          absl::StrCat(std::strerror(EEXIST), " (creating its temporary ", temporary, ")"));
    }
    if (proc) {
      return ReportFile(path, std::move(temporary), unnamed, /*direct=*/false, /*unnamed=*/true);
    }
    ::close(unnamed);  // no /proc: the named temporary below
  } else if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL) {
    // not the filesystem's lack of O_TMPFILE
    return absl::UnavailableError(
        absl::StrCat(std::strerror(errno), " (creating its temporary in ", directory, ")"));
  }
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat(std::strerror(errno), " (creating its temporary ", temporary, ")"));
  }
  return ReportFile(path, std::move(temporary), fd, /*direct=*/false, /*unnamed=*/false);
}

ReportFile::ReportFile(ReportFile&& other) noexcept
    : path_(std::move(other.path_)),
      temporary_path_(std::exchange(other.temporary_path_, std::string())),
      fd_(std::exchange(other.fd_, -1)),
      direct_(other.direct_),
      unnamed_(other.unnamed_) {}

ReportFile::~ReportFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!temporary_path_.empty() && !unnamed_) ::unlink(temporary_path_.c_str());
}

absl::Status ReportFile::Commit(const std::string& contents) {
  if (fd_ < 0) {  // committed (its descriptor closed) or moved from
    return absl::FailedPreconditionError(absl::StrCat(path_, ": the report is already written"));
  }
  const std::string& written = direct_ ? path_ : temporary_path_;
  if (direct_) {  // a link's regular target is replaced, not appended to
    struct stat st {};
    if (::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode) && ::ftruncate(fd_, 0) != 0) {
      return ErrnoError(absl::StrCat("cannot truncate ", path_), errno);
    }
  }
  const char* data = contents.data();
  size_t left = contents.size();
  while (left > 0) {
    const ssize_t n = ::write(fd_, data, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError(absl::StrCat("cannot write ", written), errno);
    data += n;
    left -= static_cast<size_t>(n);
  }
  if (direct_) {  // a device or a FIFO has nothing to sync or rename
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) return ErrnoError(absl::StrCat("cannot close ", path_), errno);
    return absl::OkStatus();
  }
  if (::fsync(fd_) != 0) return ErrnoError(absl::StrCat("cannot sync ", temporary_path_), errno);
  if (unnamed_) {  // named now, for the rename (linkat through /proc needs no privilege)
    const std::string self = absl::StrCat("/proc/self/fd/", fd_);
    if (::linkat(AT_FDCWD, self.c_str(), AT_FDCWD, temporary_path_.c_str(), AT_SYMLINK_FOLLOW) !=
        0) {
      return ErrnoError(absl::StrCat("cannot name ", temporary_path_), errno);
    }
    unnamed_ = false;  // from here on a failure removes the name, as for a named temporary
  }
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) return ErrnoError(absl::StrCat("cannot close ", temporary_path_), errno);
  if (::rename(temporary_path_.c_str(), path_.c_str()) != 0) {
    return ErrnoError(absl::StrCat("cannot rename ", temporary_path_, " to ", path_), errno);
  }
  temporary_path_.clear();
  return absl::OkStatus();
}

}  // namespace eps::load
