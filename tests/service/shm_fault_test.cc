// Hardening, class 1: shared memory that changes under epsd. An engine that
// shrinks its shm object after Attach must not crash epsd (SIGBUS) or harm the
// other sessions; a shm name that is not one plain name is INVALID_ARGUMENT.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <optional>
#include <string>

#include "absl/strings/escaping.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/host_memory.h"
#include "service/peer.h"
#include "tests/core/test_util.h"
#include "tests/service/epsd_process.h"
#include "tests/service/raw_calls.h"
#include "tests/service/test_engine.h"

namespace eps {
namespace {

using testing::EpsdProcess;
using testing::TestEngine;

void Shrink(const std::string& shm_name, off_t size) {
  const int fd = shm_open(shm_name.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0) << shm_name;
  ASSERT_EQ(ftruncate(fd, size), 0);
  close(fd);
}

TEST(ShmChangesUnderEpsd, ShrunkObjectFailsItsSessionsStepAndEpsdServesTheOthers) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("shm-shrink"));
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  TestEngine bad(testing::SmallServiceModel(), 1, 1024, 1, seed);
  TestEngine good(testing::SmallServiceModel(), 1, 1024, 1, seed + 1);
  bad.Fill(0, 0, 1024);
  good.Fill(0, 0, 1024);
  v1::AttachResponse bad_session, good_session;
  ASSERT_TRUE(testing::RawAttach(*stub, bad.Attach("engine-shrinks"), &bad_session).ok());
  ASSERT_TRUE(testing::RawAttach(*stub, good.Attach("engine-good"), &good_session).ok());
  const std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 1000)};
  ASSERT_TRUE(
      testing::RawStep(*stub, testing::StepRequest(bad_session.session_id(), 1, rows)).ok());

  Shrink(bad.buffers().shm_name(), 0);  // every page epsd mapped is gone
  const grpc::Status shrunk =
      testing::RawStep(*stub, testing::StepRequest(bad_session.session_id(), 2, rows));
  EXPECT_EQ(shrunk.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << shrunk.error_message();
  EXPECT_NE(shrunk.error_message().find(bad.buffers().shm_name()), std::string::npos)
      << shrunk.error_message();
  ASSERT_TRUE(epsd->Running()) << "epsd died:\n" << epsd->Log();

  // The other engine is served, correctly, as before.
  const grpc::Status other =
      testing::RawStep(*stub, testing::StepRequest(good_session.session_id(), 1, rows));
  EXPECT_TRUE(other.ok()) << other.error_message();
  EXPECT_TRUE(good.MatchesReference(rows));
  // And the shrunk session keeps failing rather than reading zeros as summaries.
  const grpc::Status again =
      testing::RawStep(*stub, testing::StepRequest(bad_session.session_id(), 3, rows));
  EXPECT_EQ(again.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << again.error_message();
  EXPECT_TRUE(epsd->Running());
}

TEST(ShmChangesUnderEpsd, ObjectShrunkHalfwayFailsTheStepWithoutCrashing) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("shm-half"));
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  TestEngine engine(testing::SmallServiceModel(), 2, 2048, 2, seed);
  engine.Fill(0, 0, 2048);
  engine.Fill(1, 1, 2048);
  v1::AttachResponse session;
  ASSERT_TRUE(testing::RawAttach(*stub, engine.Attach("engine-half"), &session).ok());
  Shrink(engine.buffers().shm_name(),
         static_cast<off_t>(engine.buffers().plan().size / 2) & ~off_t{4095});
  const grpc::Status status = testing::RawStep(
      *stub, testing::StepRequest(session.session_id(), 1,
                                  {TestEngine::Row(0, 2000), TestEngine::Row(1, 1500)}));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_TRUE(epsd->Running()) << epsd->Log();
  // A fresh attach of the same engine id over new, whole buffers works again.
  TestEngine fresh(testing::SmallServiceModel(), 2, 2048, 2, seed + 7);
  fresh.Fill(0, 0, 2048);
  v1::AttachResponse again;
  ASSERT_TRUE(testing::RawAttach(*stub, fresh.Attach("engine-half-2"), &again).ok());
  EXPECT_TRUE(testing::RawStep(
                  *stub, testing::StepRequest(again.session_id(), 1, {TestEngine::Row(0, 900)}))
                  .ok());
  EXPECT_TRUE(fresh.MatchesReference({TestEngine::Row(0, 900)}));
}

TEST(ShmNames, NamesThatAreNotOnePlainNameAreInvalidArgument) {
  const std::string kNames[] = {
      std::string("/eps-a\0b", 8),  // NUL: the kernel would see "/eps-a"
      "/..",
      "/.",
      "/",
      "//eps",
      "/dir/eps",
      "eps",
      "/eps\n",
      "/eps\x7f",
      "/" + std::string(255, 'x'),  // longer than NAME_MAX
  };
  for (const std::string& name : kNames) {
    absl::StatusOr<std::unique_ptr<service::HostMemory>> memory =
        service::HostMemory::MapShm(name, 4096);
    EXPECT_EQ(memory.status().code(), absl::StatusCode::kInvalidArgument)
        << absl::CHexEscape(name) << ": " << memory.status();
  }
}

// A refused name is quoted in part: the whole of it, escaped (up to 4 bytes a byte), once
// came back in the message and went on into the step log.
TEST(ShmNames, ARefusedNameIsQuotedOnlyInPart) {
  const std::string name = "/" + std::string(1 << 20, '\x01');
  absl::StatusOr<std::unique_ptr<service::HostMemory>> memory =
      service::HostMemory::MapShm(name, 4096);
  EXPECT_EQ(memory.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LE(memory.status().message().size(), 1024u) << memory.status().message().substr(0, 200);
  EXPECT_NE(memory.status().message().find("(1048577 bytes)"), std::string::npos);
}

TEST(ShmNames, NulInANameIsRefusedEvenWhenItsPrefixExists) {
  const std::string prefix = "/eps-shmname-" + std::to_string(getpid());
  const int fd = shm_open(prefix.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  absl::StatusOr<std::unique_ptr<service::HostMemory>> memory =
      service::HostMemory::MapShm(prefix + std::string("\0tail", 5), 4096);
  EXPECT_EQ(memory.status().code(), absl::StatusCode::kInvalidArgument) << memory.status();
  shm_unlink(prefix.c_str());
}

TEST(ShmNames, AFifoUnderDevShmIsNotMapped) {
  const std::string name = "/eps-fifo-" + std::to_string(getpid());
  ASSERT_EQ(mkfifo(("/dev/shm" + name).c_str(), 0600), 0);
  absl::StatusOr<std::unique_ptr<service::HostMemory>> memory =
      service::HostMemory::MapShm(name, 4096);
  EXPECT_EQ(memory.status().code(), absl::StatusCode::kInvalidArgument) << memory.status();
  unlink(("/dev/shm" + name).c_str());
}

TEST(ShmDescriptors, OutOfDescriptorsIsResourceExhaustedNamingTheLimit) {
  const std::string name = "/eps-emfile-" + std::to_string(getpid());
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  // The lowest free descriptor as the limit: the next open is EMFILE.
  const int lowest = dup(0);
  ASSERT_GE(lowest, 0);
  close(lowest);
  rlimit lowered = saved;
  lowered.rlim_cur = static_cast<rlim_t>(lowest);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  absl::StatusOr<std::unique_ptr<service::HostMemory>> memory =
      service::HostMemory::MapShm(name, 4096);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  shm_unlink(name.c_str());
  EXPECT_EQ(memory.status().code(), absl::StatusCode::kResourceExhausted) << memory.status();
  EXPECT_THAT(std::string(memory.status().message()),
              ::testing::HasSubstr("open-file limit (RLIMIT_NOFILE)"));
}

TEST(ShmOwners, AnObjectOfAnotherUserIsNotMappedForACaller) {
  const std::string name = "/eps-shmowner-" + std::to_string(getpid());
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  close(fd);
  const uid_t me = geteuid();
  // Its owner, and no owner asked: mapped.
  for (const std::optional<uid_t> owner : {std::optional<uid_t>(me), std::optional<uid_t>()}) {
    absl::StatusOr<std::unique_ptr<service::HostMemory>> memory =
        service::HostMemory::MapShm(name, 4096, owner);
    EXPECT_TRUE(memory.ok()) << memory.status();
  }
  // Another user: refused before it is mapped, naming both users.
  absl::StatusOr<std::unique_ptr<service::HostMemory>> other =
      service::HostMemory::MapShm(name, 4096, me + 1);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kPermissionDenied) << other.status();
  EXPECT_THAT(std::string(other.status().message()),
              ::testing::HasSubstr("belongs to uid " + std::to_string(me) + ", not to uid " +
                                   std::to_string(me + 1)));
  shm_unlink(name.c_str());
}

TEST(ShmOwners, ACallerMayNameItsOwnObjectsAndRootAnyUnknownCallersEpsdsOwn) {
  service::Peer user{.known = true, .uid = 1234, .pid = 1};
  EXPECT_EQ(service::ShmOwnerFor(user), std::optional<uid_t>(1234));
  service::Peer root{.known = true, .uid = 0, .pid = 1};
  EXPECT_EQ(service::ShmOwnerFor(root), std::nullopt);
  EXPECT_EQ(service::ShmOwnerFor(service::Peer{}), std::optional<uid_t>(geteuid()));
}

}  // namespace
}  // namespace eps
