// ReportFile: eps-load's --json report, written whole or not at all.
//
// Open() creates a temporary file beside the report (same directory, so the final rename
// is atomic) and so proves before the run that the report can be written, without touching
// an existing report. Commit() writes the contents and renames the temporary over the
// report. A ReportFile destroyed without a successful Commit() removes its temporary: a run
// that fails or is stopped before its report leaves the previous report as it was.
//
// Not thread-safe; one owner.
#pragma once

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace eps::load {

class ReportFile {
 public:
  // Creates `path`'s temporary (mode 0666 less the umask, as a plain create would).
  // An error names the path and the system call's reason.
  static absl::StatusOr<ReportFile> Open(const std::string& path);

  ReportFile(ReportFile&& other) noexcept;
  ReportFile& operator=(ReportFile&&) = delete;
  ReportFile(const ReportFile&) = delete;
  ReportFile& operator=(const ReportFile&) = delete;
  ~ReportFile();

  // Writes `contents` to the temporary, flushes it and renames it to the report's path.
  absl::Status Commit(const std::string& contents);

  const std::string& temporary_path() const { return temporary_path_; }

 private:
  ReportFile(std::string path, std::string temporary_path, int fd)
      : path_(std::move(path)), temporary_path_(std::move(temporary_path)), fd_(fd) {}

  std::string path_;
  std::string temporary_path_;  // empty once committed or moved from
  int fd_ = -1;
};

}  // namespace eps::load
