// ReportFile: eps-load's --json report, written whole or not at all.
//
// A path that is a regular file or does not exist yet: Open() creates a temporary file
// beside the report (same directory, so the final rename is atomic) and so proves before
// the run that the report can be written, without touching an existing report. Commit()
// writes the contents and renames the temporary over the report. A ReportFile destroyed
// without a successful Commit() removes its temporary: a run that fails or is stopped
// before its report leaves the previous report as it was. The temporary has no name until
// Commit() (O_TMPFILE, then `path.PID.tmp` for the rename), so a process killed by a signal
// eps-load does not handle leaves nothing; on a filesystem without O_TMPFILE it is
// `path.PID.tmp` from the start, and such a process leaves it.
// A path that exists as anything else: a directory is refused at Open(); a symbolic link,
// a device (/dev/stdout) or a FIFO is opened at Open() and written through at Commit()
// (a link's target truncated then, not before), as a plain open would.
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

 private:
  ReportFile(std::string path, std::string temporary_path, int fd, bool direct, bool unnamed)
      : path_(std::move(path)),
        temporary_path_(std::move(temporary_path)),
        fd_(fd),
        direct_(direct),
        unnamed_(unnamed) {}

  std::string path_;
  std::string temporary_path_;  // empty once committed or moved from (and when direct)
  int fd_ = -1;
  bool direct_ = false;   // written through the path itself (not a regular file)
  bool unnamed_ = false;  // the temporary is an O_TMPFILE not yet linked as temporary_path_
};

}  // namespace eps::load
