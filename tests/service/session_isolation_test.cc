// Hardening, class 4: session isolation. A session id is an unguessable
// capability returned only to the attacher; a session is bound to the user of
// the process that attached it (SO_PEERCRED on the Unix socket): another user
// can neither step, inspect, detach nor replace it, and the listing shows no
// session ids (docs/security.md).
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/service/epsd_process.h"
#include "tests/service/raw_calls.h"
#include "tests/service/test_engine.h"

namespace eps {
namespace {

using testing::EpsdProcess;
using testing::TestEngine;

// The random part of an id: what follows its last '-'.
std::string RandomPart(const std::string& id) { return id.substr(id.rfind('-') + 1); }

TEST(SessionIsolation, SessionIdsCarryAtLeast128RandomBits) {
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("iso-ids"));
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  TestEngine engine(testing::SmallServiceModel(), 1, 512, 1, 5);
  std::set<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    v1::AttachResponse response;
    ASSERT_TRUE(
        testing::RawAttach(*stub, engine.Attach("engine-id-" + std::to_string(i)), &response).ok());
    const std::string random = RandomPart(response.session_id());
    EXPECT_GE(random.size(), 32u) << response.session_id();
    EXPECT_EQ(random.find_first_not_of("0123456789abcdef"), std::string::npos)
        << response.session_id();
    ids.insert(random);
  }
  EXPECT_EQ(ids.size(), 4u);
}

TEST(SessionIsolation, TheListingShowsNoSessionIds) {
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("iso-list"));
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  TestEngine engine(testing::SmallServiceModel(), 1, 512, 1, 6);
  v1::AttachResponse attached;
  ASSERT_TRUE(testing::RawAttach(*stub, engine.Attach("engine-listed"), &attached).ok());
  grpc::ClientContext context;
  v1::GetStatsResponse stats;
  ASSERT_TRUE(stub->GetStats(&context, v1::GetStatsRequest(), &stats).ok());
  EXPECT_EQ(stats.sessions_active(), 1u);
  ASSERT_EQ(stats.sessions_size(), 1);
  EXPECT_EQ(stats.sessions(0).session_id(), "");  // a capability is never listed
  EXPECT_EQ(stats.sessions(0).engine_id(), "engine-listed");
  // The attacher, naming its own id, sees it.
  grpc::ClientContext own_context;
  v1::GetStatsRequest own;
  own.set_session_id(attached.session_id());
  v1::GetStatsResponse own_stats;
  ASSERT_TRUE(stub->GetStats(&own_context, own, &own_stats).ok());
  ASSERT_EQ(own_stats.sessions_size(), 1);
  EXPECT_EQ(own_stats.sessions(0).session_id(), attached.session_id());
}

// Runs peer_probe as user `uid`, and returns its output line.
std::string ProbeAs(uid_t uid, const std::string& target, const std::string& session,
                    const std::string& engine, const std::string& attach_file = "") {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return "pipe failed";
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(pipe_fds[1], 1);
    close(pipe_fds[0]);
    if (setgroups(0, nullptr) != 0 || setresgid(uid, uid, uid) != 0 ||
        setresuid(uid, uid, uid) != 0) {
      _exit(3);
    }
    if (attach_file.empty()) {
      execl(PEER_PROBE_PATH, PEER_PROBE_PATH, target.c_str(), session.c_str(), engine.c_str(),
            static_cast<char*>(nullptr));
    } else {
      execl(PEER_PROBE_PATH, PEER_PROBE_PATH, target.c_str(), session.c_str(), engine.c_str(),
            attach_file.c_str(), static_cast<char*>(nullptr));
    }
    _exit(4);
  }
  close(pipe_fds[1]);
  std::string out;
  char buffer[256];
  for (ssize_t n; (n = read(pipe_fds[0], buffer, sizeof(buffer))) > 0;) out.append(buffer, n);
  close(pipe_fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return out;
}

// The other user's Attach of the victim's engine_id opens that user's own session
// (engine ids are per user): it neither replaces the victim's nor is refused, so no
// user can hold another's engine_id.
TEST(SessionIsolation, AnotherUserCannotStepInspectDetachOrReplaceASession) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the probe as another user";
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  // Mode 0666: the other user may reach the socket; the session must still be out of its reach.
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("iso-peer"), {"--socket-mode=0666"});
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  TestEngine engine(testing::SmallServiceModel(), 1, 1024, 1, seed);
  engine.Fill(0, 0, 1024);
  v1::AttachResponse attached;
  ASSERT_TRUE(testing::RawAttach(*stub, engine.Attach("engine-victim"), &attached).ok());
  const std::string line = ProbeAs(65534, epsd->target(), attached.session_id(), "engine-victim");
  int step = -1, stats = -1, detach = -1, replace = -1, listed = -1;
  ASSERT_EQ(std::sscanf(line.c_str(), "step=%d stats=%d detach=%d replace=%d listed=%d", &step,
                        &stats, &detach, &replace, &listed),
            5)
      << line;
  EXPECT_EQ(step, grpc::StatusCode::PERMISSION_DENIED) << line;
  EXPECT_EQ(stats, grpc::StatusCode::PERMISSION_DENIED) << line;
  EXPECT_EQ(detach, grpc::StatusCode::PERMISSION_DENIED) << line;
  EXPECT_EQ(replace, grpc::StatusCode::OK) << line;
  EXPECT_EQ(listed, 0) << line;
  // The owner's session is untouched and still served.
  const std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 1000)};
  const grpc::Status own =
      testing::RawStep(*stub, testing::StepRequest(attached.session_id(), 1, rows));
  EXPECT_TRUE(own.ok()) << own.error_message();
  EXPECT_TRUE(engine.MatchesReference(rows));
}

TEST(SessionIsolation, OverTcpASessionIsReplacedOnlyAfterItsLeaseOrItsDetach) {
  // Over TCP epsd cannot tell who attached a session, and GetStats lists engine ids: an
  // Attach naming a live session's engine_id must not evict it (ALREADY_EXISTS), so the
  // owner keeps stepping; once that session is detached, or its lease has run out, the
  // engine_id is free again.
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  // A 2 s lease: the owner must outlive the calls up to its step however loaded the machine
  // (a 300 ms one could run out between the two Attach calls, and the second then took it).
  auto epsd = EpsdProcess::Start("127.0.0.1:0", {"--lease-ms=2000"});
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  TestEngine engine(testing::SmallServiceModel(), 1, 1024, 1, seed);
  engine.Fill(0, 0, 1024);
  v1::AttachResponse owner;
  ASSERT_TRUE(testing::RawAttach(*stub, engine.Attach("engine-tcp"), &owner).ok());
  const std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 1000)};
  uint64_t step = 0;
  auto step_ok = [&](const std::string& id) {
    return testing::RawStep(*stub, testing::StepRequest(id, ++step, rows)).ok();
  };
  v1::AttachResponse taken;
  const grpc::Status refused = testing::RawAttach(*stub, engine.Attach("engine-tcp"), &taken);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::ALREADY_EXISTS) << refused.error_message();
  EXPECT_TRUE(step_ok(owner.session_id()));
  EXPECT_TRUE(engine.MatchesReference(rows));
  // Detached with its id: the engine_id is free at once.
  {
    grpc::ClientContext context;
    v1::DetachRequest detach;
    detach.set_session_id(owner.session_id());
    v1::DetachResponse done;
    ASSERT_TRUE(stub->Detach(&context, detach, &done).ok());
  }
  v1::AttachResponse second;
  ASSERT_TRUE(testing::RawAttach(*stub, engine.Attach("engine-tcp"), &second).ok());
  EXPECT_TRUE(step_ok(second.session_id()));
  // Left idle past its 2 s lease (and before the reaper, which runs every 200 ms, or
  // after it): replaced.
  std::this_thread::sleep_for(std::chrono::milliseconds(2300));
  v1::AttachResponse third;
  const grpc::Status after = testing::RawAttach(*stub, engine.Attach("engine-tcp"), &third);
  EXPECT_TRUE(after.ok()) << after.error_message();
}

TEST(SessionIsolation, AnotherUserCannotAttachBuffersItCannotOpen) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run the probe as another user";
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  // epsd runs as root and could open any object; the engine's shm objects belong to root
  // (mode 0600), so the other user could not open them itself, and epsd must not do it
  // for it: an Attach of its own naming them is PERMISSION_DENIED.
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("iso-shm"), {"--socket-mode=0666"});
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  TestEngine engine(testing::SmallServiceModel(), 1, 1024, 1, seed);
  engine.Fill(0, 0, 1024);
  v1::AttachResponse attached;
  ASSERT_TRUE(testing::RawAttach(*stub, engine.Attach("engine-owner"), &attached).ok());
  const std::string file = "/tmp/eps-borrow-" + std::to_string(getpid()) + ".bin";
  {
    std::ofstream out(file, std::ios::binary);
    ASSERT_TRUE(engine.Attach("engine-borrower").SerializeToOstream(&out));
  }
  ASSERT_EQ(chmod(file.c_str(), 0644), 0);
  const std::string line =
      ProbeAs(65534, epsd->target(), attached.session_id(), "engine-owner", file);
  std::remove(file.c_str());
  const size_t at = line.find("borrow=");
  ASSERT_NE(at, std::string::npos) << line;
  EXPECT_EQ(std::atoi(line.c_str() + at + 7), grpc::StatusCode::PERMISSION_DENIED) << line;
  // The same request from root (the objects' owner) attaches.
  v1::AttachResponse own;
  EXPECT_TRUE(testing::RawAttach(*stub, engine.Attach("engine-borrower"), &own).ok());
}

}  // namespace
}  // namespace eps
