// client/cpp/engine_buffers.cc's stale-object reaping: Create removes the /dev/shm objects
// of its tag that a dead process left, and nothing else (docs/api-memory.md §3.3). Each
// test uses a tag of its own with this process's pid in it, so that tests running side
// by side never see each other's objects.
#include "client/cpp/engine_buffers.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace eps::client {
namespace {

using std::chrono_literals::operator""s;

ModelLayout Model() {
  ModelLayout m;
  m.num_layers = 2;
  m.num_q_heads = 2;
  m.num_kv_heads = 1;
  m.head_dim = 8;
  return m;
}

BufferShape Shape() {
  BufferShape s;
  s.num_slots = 4;
  s.max_seqs = 2;
  s.max_context = 256;
  s.max_batch = 2;
  return s;
}

std::string Tag(const std::string& test) { return absl::StrCat(test, getpid()); }

bool Exists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd >= 0) close(fd);
  return fd >= 0;
}

// The /dev/shm entries whose names start with `prefix`.
std::vector<std::string> ShmEntries(const std::string& prefix) {
  std::vector<std::string> found;
  std::unique_ptr<DIR, int (*)(DIR*)> dir(opendir("/dev/shm"), closedir);
  while (dir != nullptr) {
    const dirent* entry = readdir(dir.get());
    if (entry == nullptr) break;
    if (absl::StartsWith(entry->d_name, prefix)) found.push_back(entry->d_name);
  }
  return found;
}

// Makes every flock(2) of this process fail with `err`, as on a /dev/shm without flock.
bool FailFlock(int err) {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_flock, 0, 1),
      BPF_STMT(BPF_RET | BPF_K,
               SECCOMP_RET_ERRNO | (static_cast<unsigned>(err) & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog program{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
  return prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) == 0;
}

// An object no one holds, as one is between its creation and its creator's lock.
void MakeUnheld(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0) << name << ": " << std::strerror(errno);
  EXPECT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
}

// A child process that creates `count` EngineBuffers of `tag` and lives, holding them,
// until killed (-9, as a crashed engine dies: no destructor runs).
class Creator {
 public:
  Creator(const std::string& tag, int count) {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      close(fds[0]);
      std::vector<std::unique_ptr<EngineBuffers>> held;
      std::string names;
      for (int i = 0; i < count; ++i) {
        auto made = EngineBuffers::Create(Model(), Shape(), tag);
        if (!made.ok()) _exit(1);
        absl::StrAppend(&names, (*made)->shm_name(), "\n");
        held.push_back(*std::move(made));
      }
      if (write(fds[1], names.data(), names.size()) != static_cast<ssize_t>(names.size())) {
        _exit(1);
      }
      close(fds[1]);
      for (;;) pause();
    }
    close(fds[1]);
    std::string out;
    char chunk[256];
    ssize_t n;
    while ((n = read(fds[0], chunk, sizeof chunk)) > 0) {
      out.append(chunk, static_cast<size_t>(n));
      if (std::count(out.begin(), out.end(), '\n') == count) break;
    }
    close(fds[0]);
    names_ = absl::StrSplit(out, '\n', absl::SkipEmpty());
  }
  ~Creator() {
    Kill();
    for (const std::string& name : names_) shm_unlink(name.c_str());  // after a failure
  }
  Creator(const Creator&) = delete;
  Creator& operator=(const Creator&) = delete;

  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  const std::vector<std::string>& names() const { return names_; }

 private:
  pid_t pid_ = -1;
  std::vector<std::string> names_;
};

TEST(StaleShmTest, TheObjectsOfAKilledCreatorAreRemovedByTheNextCreate) {
  const std::string tag = Tag("killed");
  Creator creator(tag, 2);
  ASSERT_EQ(creator.names().size(), 2u) << "the child could not create its buffers";
  creator.Kill();
  for (const std::string& name : creator.names()) ASSERT_TRUE(Exists(name)) << name;

  auto next = EngineBuffers::Create(Model(), Shape(), tag, 0s);
  ASSERT_TRUE(next.ok()) << next.status();
  for (const std::string& name : creator.names()) EXPECT_FALSE(Exists(name)) << name;
  EXPECT_TRUE(Exists((*next)->shm_name()));
}

TEST(StaleShmTest, TheObjectOfALiveCreatorIsKept) {
  const std::string tag = Tag("live");
  Creator creator(tag, 1);
  ASSERT_EQ(creator.names().size(), 1u) << "the child could not create its buffers";
  auto next = EngineBuffers::Create(Model(), Shape(), tag, 0s);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(Exists(creator.names()[0]));
  EXPECT_TRUE(ReapStaleShm(tag, 0s).value().empty()) << "this process's own object was taken";

  // Only the lock kept it: once its creator is gone, it goes.
  creator.Kill();
  EXPECT_EQ(ReapStaleShm(tag, 0s).value(), creator.names());
}

TEST(StaleShmTest, AnUnheldObjectYoungerThanTheGracePeriodIsKept) {
  const std::string tag = Tag("young");
  const std::string young = absl::StrCat("/eps-", tag, "-1-0");
  MakeUnheld(young);
  auto next = EngineBuffers::Create(Model(), Shape(), tag);  // kStaleShmGrace
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(Exists(young));

  // Only its age kept it.
  EXPECT_EQ(ReapStaleShm(tag, 0s).value(), std::vector<std::string>{young});
  shm_unlink(young.c_str());  // after a failure
}

TEST(StaleShmTest, OnlyTheNamesCreateMakesForTheTagAreRemoved) {
  const std::string tag = Tag("names");
  const std::string prefix = absl::StrCat("/eps-", tag, "-");
  const std::vector<std::string> reaped = {
      prefix + "1-0", prefix + "4194304-4294967295",
      prefix + "1-2-0123456789abcdef",  // the random suffix (16 digits, both clients)
  };
  const std::vector<std::string> kept = {
      absl::StrCat("/eps-", tag, "x-1-0"),       // another tag
      absl::StrCat("/eps-x", tag, "-1-0"),       // another tag
      absl::StrCat("/eps-", tag, "-other-1-0"),  // another tag
      prefix + "1-0-0-0",
      absl::StrCat("/epsx-", tag, "-1-0"),
      absl::StrCat("/x-eps-", tag, "-1-0"),
      prefix + "1",
      prefix + "1-",
      prefix + "-1-0",
      prefix + "1-0-",
      prefix + "1-0-ABC",
      prefix + "1-0-xyz",
      prefix + "1-0-0123456789abcdef0",
      prefix + "1-1-abc",        // a suffix of fewer than 16 digits (before 2026-11-28)
      prefix + "1-100-5",        // tag <tag>-1's pid 100, count 5 (read as ours before)
      prefix + "12345678-0",     // a pid of 8 digits
      prefix + "1-12345678901",  // a count of 11 digits
      prefix + "1-0.lock",
      prefix + "+1-0",
      prefix + "\xd9\xa1-0",  // an Arabic-Indic digit one (UTF-8)
  };
  for (const std::string& name : reaped) MakeUnheld(name);
  for (const std::string& name : kept) MakeUnheld(name);

  auto next = EngineBuffers::Create(Model(), Shape(), tag, 0s);
  ASSERT_TRUE(next.ok()) << next.status();
  for (const std::string& name : reaped) {
    EXPECT_FALSE(Exists(name)) << name;
    shm_unlink(name.c_str());  // after a failure
  }
  for (const std::string& name : kept) {
    EXPECT_TRUE(Exists(name)) << name;
    shm_unlink(name.c_str());
  }
}

// Where one tag is another's prefix and a '-' ("t" and "t-1"), neither tag's reaping takes
// the other's objects, whichever way round: "eps-t-1-100-5" is t-1's (pid 100, count 5), and
// "eps-t-1-5-0123456789012345" t's (pid 1, count 5, an all-decimal suffix).
TEST(StaleShmTest, ATagThatExtendsAnotherTakesNoneOfItsObjectsNorGivesItsOwn) {
  const std::string tag = Tag("pre");
  const std::string longer = absl::StrCat("/eps-", tag, "-1-100-5");                // tag-1's
  const std::string shorter = absl::StrCat("/eps-", tag, "-1-5-0123456789012345");  // tag's
  MakeUnheld(longer);
  MakeUnheld(shorter);
  {
    auto made = EngineBuffers::Create(Model(), Shape(), tag, 0s);
    ASSERT_TRUE(made.ok()) << made.status();
    EXPECT_TRUE(Exists(longer));
    EXPECT_FALSE(Exists(shorter));
  }
  MakeUnheld(shorter);
  {
    auto made = EngineBuffers::Create(Model(), Shape(), absl::StrCat(tag, "-1"), 0s);
    ASSERT_TRUE(made.ok()) << made.status();
    EXPECT_TRUE(Exists(shorter));
    EXPECT_FALSE(Exists(longer));
  }
  shm_unlink(longer.c_str());
  shm_unlink(shorter.c_str());
}

// A negative grace period would take an object whose creator has not locked it yet (one as
// young as can be): refused, naming the value, before anything is removed or created.
TEST(StaleShmTest, ANegativeGracePeriodIsRefusedBeforeAnythingIsRemoved) {
  const std::string tag = Tag("grace");
  const std::string young = absl::StrCat("/eps-", tag, "-1-0");
  MakeUnheld(young);
  {
    auto made = EngineBuffers::Create(Model(), Shape(), tag, -1s);
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << made.status();
    EXPECT_TRUE(absl::StrContains(made.status().message(), "stale_grace=-1s")) << made.status();
    EXPECT_EQ(ShmEntries(absl::StrCat("eps-", tag, "-")),
              std::vector<std::string>{young.substr(1)});
  }
  absl::StatusOr<std::vector<std::string>> reaped = ReapStaleShm(tag, -1s);
  EXPECT_EQ(reaped.status().code(), absl::StatusCode::kInvalidArgument) << reaped.status();
  EXPECT_TRUE(absl::StrContains(reaped.status().message(), "grace=-1s")) << reaped.status();
  EXPECT_TRUE(Exists(young));
  shm_unlink(young.c_str());
}

// Checked before it is opened: opening a FIFO wakes a writer waiting on it (a device would
// do more). inotify reports every open of the FIFO, here none.
TEST(StaleShmTest, WhatIsNoRegularFileUnderTheTagsNamesIsNotEvenOpened) {
  const std::string tag = Tag("unopened");
  const std::string fifo = absl::StrCat("/dev/shm/eps-", tag, "-1-0");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const int watch = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  ASSERT_GE(watch, 0) << std::strerror(errno);
  ASSERT_GE(inotify_add_watch(watch, fifo.c_str(), IN_OPEN | IN_DONT_FOLLOW), 0)
      << std::strerror(errno);

  EXPECT_TRUE(ReapStaleShm(tag, 0s).value().empty());
  char events[4096];
  const ssize_t n = read(watch, events, sizeof events);
  EXPECT_TRUE(n < 0 && errno == EAGAIN) << "the reaper opened the FIFO (" << n << " bytes)";
  close(watch);
  unlink(fifo.c_str());
}

// Entries under the tag's names that are no objects: a FIFO (an open that waited on it
// would hang the engine's Create) and a symlink to an unheld object of the same user (the
// link is not the object; neither is followed). Both stay, and Create returns.
TEST(StaleShmTest, AFifoOrSymlinkUnderTheTagsNamesIsLeftAlone) {
  const std::string tag = Tag("special");
  const std::string fifo = absl::StrCat("/eps-", tag, "-1-0");
  const std::string link = absl::StrCat("/eps-", tag, "-1-1");
  const std::string target = absl::StrCat("/eps-", tag, "x-1-0");  // another tag's: kept
  ASSERT_EQ(mkfifo(("/dev/shm" + fifo).c_str(), 0600), 0) << std::strerror(errno);
  MakeUnheld(target);
  ASSERT_EQ(symlink(("/dev/shm" + target).c_str(), ("/dev/shm" + link).c_str()), 0)
      << std::strerror(errno);

  auto next = EngineBuffers::Create(Model(), Shape(), tag, 0s);
  ASSERT_TRUE(next.ok()) << next.status();
  struct stat st {};
  EXPECT_EQ(lstat(("/dev/shm" + fifo).c_str(), &st), 0) << fifo;
  EXPECT_EQ(lstat(("/dev/shm" + link).c_str(), &st), 0) << link;
  EXPECT_TRUE(Exists(target));
  for (const std::string& name : {fifo, link, target}) unlink(("/dev/shm" + name).c_str());
}

// A forked child has a copy of the parent's EngineBuffers (and of its lock's descriptor).
// Its destructor, run in the child, must not remove the live parent's object: epsd opens
// it again by name when the engine re-attaches.
TEST(StaleShmTest, AForkedChildsDestructorLeavesItsParentsObjectNamedAndHeld) {
  const std::string tag = Tag("fork");
  auto made = EngineBuffers::Create(Model(), Shape(), tag, 0s);
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<EngineBuffers> buffers = *std::move(made);
  const std::string name = buffers->shm_name();
  const pid_t child = fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    buffers.reset();
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_TRUE(Exists(name)) << "the child removed its parent's object";
  EXPECT_TRUE(ReapStaleShm(tag, 0s).value().empty())
      << "the parent's lock went with the child's copy";
  buffers.reset();
  EXPECT_FALSE(Exists(name));
}

// A /dev/shm whose flock fails (ENOLCK): an unheld object would be taken for a dead
// engine's, so Create makes none and says why (docs/api-memory.md §3.3).
TEST(StaleShmTest, WithoutFlockCreateFailsAndLeavesNoObject) {
  const std::string tag = Tag("nolock");
  const pid_t child = fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {  // the filter stays with the child
    if (!FailFlock(ENOLCK)) _exit(2);
    auto made = EngineBuffers::Create(Model(), Shape(), tag);
    const bool refused = !made.ok() && made.status().code() == absl::StatusCode::kInternal &&
                         absl::StrContains(made.status().message(), "flock(LOCK_SH)");
    _exit(refused ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  ASSERT_NE(WEXITSTATUS(status), 2) << "seccomp could not be set up";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "Create did not fail naming flock(LOCK_SH)";
  const std::vector<std::string> left = ShmEntries(absl::StrCat("eps-", tag, "-"));
  EXPECT_TRUE(left.empty()) << left[0];
  for (const std::string& name : left) shm_unlink(("/" + name).c_str());
}

}  // namespace
}  // namespace eps::client
