// The session registry: a session that leaves it (replaced, removed) is torn down
// by the caller after the registry's lock is released, so its teardown (munmap,
// the cuda backend's stream synchronisation) never stalls another engine's Find;
// engine ids are per user, so no user can hold another's.
#include "service/session_registry.h"

#include <chrono>
#include <future>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "service/session_service.h"
#include "tests/core/test_util.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

using eps::testing::TestEngine;

class SessionRegistryTest : public ::testing::Test {
 protected:
  SessionRegistryTest()
      : engine_(eps::testing::SmallServiceModel(), /*max_seqs=*/1, /*max_context=*/256,
                /*max_batch=*/1, eps::testing::TestSeed()) {}
  ~SessionRegistryTest() override { watching_ = false; }  // the registry goes first

  // A session of `engine_id` whose teardown checks that another thread can use the
  // registry meanwhile (it could not while Add or Remove held the lock).
  std::shared_ptr<Session> Watched(const std::string& id, const std::string& engine_id) {
    absl::StatusOr<std::unique_ptr<Session>> built =
        Session::Create(engine_.Attach(engine_id), config_, budget_, Peer{});
    EXPECT_TRUE(built.ok()) << built.status();
    (*built)->set_id(id);
    return std::shared_ptr<Session>(built->release(), [this](Session* session) {
      if (!watching_) {
        delete session;
        return;
      }
      // Kept past the deleter: were the lock held, its end would wait for the lock.
      find_ = std::async(std::launch::async, [this] { return registry_.size(); });
      freed_outside_lock_ = find_.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
      ++freed_;
      delete session;
    });
  }

  TestEngine engine_;
  ServerConfig config_;
  ServerBudgets budget_{
      .allocated = MemoryBudget("--max-server-bytes", config_.max_server_bytes),
      .mapped = MemoryBudget("--max-server-mapped-bytes", config_.max_server_mapped_bytes)};
  SessionRegistry registry_;
  std::future<size_t> find_;
  bool watching_ = true;
  int freed_ = 0;
  bool freed_outside_lock_ = false;
};

TEST_F(SessionRegistryTest, AReplacedSessionIsFreedOutsideTheRegistryLock) {
  ASSERT_TRUE(registry_.Add(Watched("s-1", "engine-a"), {.max_sessions = 8}).ok());
  absl::StatusOr<std::shared_ptr<Session>> replaced =
      registry_.Add(Watched("s-2", "engine-a"), {.max_sessions = 8});
  ASSERT_TRUE(replaced.ok()) << replaced.status();
  ASSERT_NE(*replaced, nullptr);
  EXPECT_EQ((*replaced)->id(), "s-1");
  EXPECT_EQ(freed_, 0);  // the caller holds it, not the registry
  replaced->reset();
  EXPECT_EQ(freed_, 1);
  EXPECT_TRUE(freed_outside_lock_);
  EXPECT_EQ(registry_.Find("s-1"), nullptr);
  EXPECT_NE(registry_.Find("s-2"), nullptr);
}

TEST_F(SessionRegistryTest, ARemovedSessionIsFreedOutsideTheRegistryLock) {
  ASSERT_TRUE(registry_.Add(Watched("s-1", "engine-a"), {.max_sessions = 8}).ok());
  std::shared_ptr<Session> removed = registry_.Remove("s-1");
  ASSERT_NE(removed, nullptr);
  EXPECT_EQ(freed_, 0);
  removed.reset();
  EXPECT_EQ(freed_, 1);
  EXPECT_TRUE(freed_outside_lock_);
  EXPECT_EQ(registry_.Remove("s-1"), nullptr);
}

// A build admitted to replace the engine's live session holds no slot of the limits: when
// that session goes during the build (detached, expired), the built session is published
// as a new one, only within the limits.
TEST_F(SessionRegistryTest, ASessionBuiltToReplaceOneThatWentIsPublishedOnlyWithinTheLimits) {
  const SessionLimits one{.max_sessions = 1};
  ASSERT_TRUE(registry_.Add(Watched("s-1", "engine-a"), one).ok());
  const EngineKey engine_a = EngineKey::Of(Peer{}, "engine-a");
  absl::Status admitted = absl::UnknownError("BeginBuild did not call start");
  registry_.BeginBuild(engine_a, one, [&admitted](absl::Status s) { admitted = std::move(s); });
  ASSERT_TRUE(admitted.ok()) << admitted;  // a replacement, at --max-sessions
  ASSERT_NE(registry_.Remove("s-1"), nullptr);
  ASSERT_TRUE(registry_.Add(Watched("s-2", "engine-b"), one).ok());  // the slot s-1 left
  absl::StatusOr<std::shared_ptr<Session>> refused = registry_.Add(Watched("s-3", "engine-a"), one);
  EXPECT_TRUE(absl::IsResourceExhausted(refused.status())) << refused.status();
  EXPECT_EQ(registry_.Find("s-3"), nullptr);
  ASSERT_NE(registry_.Remove("s-2"), nullptr);
  absl::StatusOr<std::shared_ptr<Session>> added = registry_.Add(Watched("s-4", "engine-a"), one);
  ASSERT_TRUE(added.ok()) << added.status();
  EXPECT_EQ(*added, nullptr);  // it replaced nothing
  registry_.EndBuild(engine_a, one);
  EXPECT_EQ(registry_.size(), 1u);
}

// A minimal session over inline buffers (no shm object, so any uid may attach it).
v1::AttachRequest InlineAttach(const std::string& engine_id) {
  v1::AttachRequest attach;
  attach.set_engine_id(engine_id);
  v1::ModelLayout* l = attach.mutable_layout();
  l->set_num_layers(1);
  l->set_num_q_heads(1);
  l->set_num_kv_heads(1);
  l->set_head_dim(4);
  l->set_block_size(16);
  l->set_group_blocks(1);
  l->set_sketch_dim(1);
  attach.set_max_batch(1);
  attach.mutable_options()->set_method(v1::METHOD_JL);
  auto inline_desc = [](v1::MemoryDescriptor* d, v1::DType dtype, std::vector<int64_t> shape) {
    d->set_dtype(dtype);
    for (int64_t s : shape) d->add_shape(s);
    d->mutable_inline_bytes();
  };
  v1::SharedBuffers* b = attach.mutable_buffers();
  inline_desc(b->mutable_summary_pool(), v1::DTYPE_FLOAT32, {1, 1, 1, 4});
  inline_desc(b->mutable_group_table(), v1::DTYPE_INT32, {1, 1});
  inline_desc(b->mutable_block_table(), v1::DTYPE_INT32, {1, 1});
  inline_desc(b->mutable_queries(), v1::DTYPE_FLOAT32, {1, 1, 1, 4});
  inline_desc(b->mutable_visit_blocks(), v1::DTYPE_INT32, {1, 1, 1});
  inline_desc(b->mutable_visit_count(), v1::DTYPE_INT32, {1, 1});
  return attach;
}

TEST(SessionEngineIdsPerUserTest, TwoUsersEnginesWithOneEngineIdAreTwoSessions) {
  ServerConfig config;
  SessionService service(config);
  const Peer victim{.known = true, .uid = 1000, .pid = 1};
  const Peer squatter{.known = true, .uid = 1001, .pid = 2};
  v1::AttachResponse squatted, own;
  ASSERT_TRUE(service.Attach(InlineAttach("vllm-0/rank0"), &squatted, squatter).ok());
  const absl::Status s = service.Attach(InlineAttach("vllm-0/rank0"), &own, victim);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_NE(own.session_id(), squatted.session_id());
  EXPECT_EQ(service.session_count(), 2u);
  // A re-attach replaces only its own user's session.
  v1::AttachResponse again;
  ASSERT_TRUE(service.Attach(InlineAttach("vllm-0/rank0"), &again, victim).ok());
  EXPECT_EQ(service.session_count(), 2u);
  v1::HeartbeatRequest beat;
  v1::HeartbeatResponse beat_response;
  beat.set_session_id(own.session_id());
  EXPECT_EQ(service.Heartbeat(beat, &beat_response, victim).code(), absl::StatusCode::kNotFound);
  beat.set_session_id(squatted.session_id());
  EXPECT_TRUE(service.Heartbeat(beat, &beat_response, squatter).ok());
}

// One user cannot fill the server: with --max-sessions-per-user the user's new engines
// are refused once it holds that many (a re-attach still replaces its own), while
// another user, and the callers over TCP as one more owner, attach as before.
TEST(SessionEngineIdsPerUserTest, OneUserCannotHoldMoreThanItsQuota) {
  ServerConfig config;
  config.max_sessions = 8;
  config.max_sessions_per_user = 2;
  SessionService service(config);
  const Peer hog{.known = true, .uid = 1000, .pid = 1};
  const Peer other{.known = true, .uid = 1001, .pid = 2};
  v1::AttachResponse response;
  ASSERT_TRUE(service.Attach(InlineAttach("hog-0"), &response, hog).ok());
  ASSERT_TRUE(service.Attach(InlineAttach("hog-1"), &response, hog).ok());
  const absl::Status refused = service.Attach(InlineAttach("hog-2"), &response, hog);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("uid 1000 holds --max-sessions-per-user=2"), std::string::npos)
      << refused;
  EXPECT_TRUE(service.Attach(InlineAttach("hog-1"), &response, hog).ok()) << "a re-attach";
  EXPECT_TRUE(service.Attach(InlineAttach("other-0"), &response, other).ok());
  EXPECT_TRUE(service.Attach(InlineAttach("tcp-0"), &response, Peer{}).ok());
  EXPECT_TRUE(service.Attach(InlineAttach("tcp-1"), &response, Peer{}).ok());
  const absl::Status tcp = service.Attach(InlineAttach("tcp-2"), &response, Peer{});
  EXPECT_EQ(tcp.code(), absl::StatusCode::kResourceExhausted) << tcp;
  EXPECT_NE(tcp.message().find("unknown credentials (TCP) hold --max-sessions-per-user=2"),
            std::string::npos)
      << tcp;
  EXPECT_EQ(service.session_count(), 5u);
  config.max_sessions_per_user = 0;  // the default: only --max-sessions counts
  SessionService open(config);
  for (int i = 0; i < 8; ++i) {
    EXPECT_TRUE(open.Attach(InlineAttach("e-" + std::to_string(i)), &response, hog).ok()) << i;
  }
  EXPECT_NE(open.Attach(InlineAttach("e-8"), &response, hog).message().find("--max-sessions=8"),
            std::string::npos);
}

}  // namespace
}  // namespace eps::service
