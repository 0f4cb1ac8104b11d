// The JSONL step log: a path that is not a regular file is refused at once (a FIFO once
// held epsd's start forever), and a disk that fills mid-line leaves that line cut, never
// merged with the next: every complete line stays one JSON object.
#include "service/telemetry/step_log.h"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eps::telemetry {
namespace {

std::string TempPath(const std::string& name) {
  return "/tmp/eps-steplog-" + std::to_string(getpid()) + "-" + name;
}

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(StepLogTest, APathThatIsNotARegularFileIsRefusedWithoutWaiting) {
  const std::string fifo = TempPath("fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  // No reader: a blocking open would wait here for good.
  absl::StatusOr<std::unique_ptr<StepLog>> log = StepLog::Open(fifo);
  EXPECT_EQ(log.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(log.status().message()), ::testing::HasSubstr("--step-log=" + fifo));
  unlink(fifo.c_str());
  // A directory, and a character device, are refused too.
  for (const std::string& path : {std::string("/tmp"), std::string("/dev/null")}) {
    absl::StatusOr<std::unique_ptr<StepLog>> other = StepLog::Open(path);
    EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition) << path;
  }
}

TEST(StepLogTest, ALineCutByAFullDiskIsEndedBeforeTheNextOne) {
  // The file takes 25 bytes of the first flush and then fails (a full disk) until the test
  // frees it; later flushes get through. Steps 1 and 2 are lost whether the writer's 200 ms
  // tick takes them in one flush or (a tick between the two Appends) in two.
  const std::string path = TempPath("full.jsonl");
  unlink(path.c_str());
  int calls = 0;  // writer thread only
  std::atomic<bool> full{true};
  auto write = [&calls, &full](int fd, const void* data, size_t size) -> ssize_t {
    ++calls;
    if (calls == 1) return ::write(fd, data, std::min<size_t>(size, 25));
    if (full.load()) {
      errno = ENOSPC;
      return -1;
    }
    return ::write(fd, data, size);
  };
  uint64_t dropped = 0;
  {
    absl::StatusOr<std::unique_ptr<StepLog>> log = StepLog::Open(path, write);
    ASSERT_TRUE(log.ok()) << log.status();
    (*log)->Append(R"({"step":1,"session":"s-1"})");  // 26 bytes: cut after 25
    (*log)->Append(R"({"step":2,"session":"s-1"})");
    // The writer flushes every 200 ms: wait until both lines are lost (one flush or two),
    // then free the disk for the next line. Bounded: 10 s.
    for (int i = 0; i < 1000 && (*log)->dropped() < 2; ++i) usleep(10000);
    dropped = (*log)->dropped();
    full.store(false);
    (*log)->Append(R"({"step":3,"session":"s-1"})");
  }                        // the destructor flushes
  EXPECT_EQ(dropped, 2u);  // step 1 cut, step 2 never written
  const std::vector<std::string> lines = absl::StrSplit(Read(path), '\n');
  ASSERT_EQ(lines.size(), 3u) << Read(path);  // the cut line, step 3, and the empty tail
  EXPECT_EQ(lines[0], R"({"step":1,"session":"s-1")");
  EXPECT_EQ(lines[1], R"({"step":3,"session":"s-1"})");
  EXPECT_EQ(lines[2], "");
  unlink(path.c_str());
}

}  // namespace
}  // namespace eps::telemetry
