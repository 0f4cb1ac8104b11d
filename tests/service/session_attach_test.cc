// In-process tests of the session service's Attach (no epsd process, no gRPC): the
// request's validation through the buffer contract, its options and its device, and
// admission: --max-sessions and the server's budgets.
#include <unistd.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "core/buffer_contract.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/cuda_backend.h"
#include "service/session_service.h"
#include "tests/core/test_util.h"
#include "tests/fuzz/fuzz_session.h"
#include "tests/service/session_service_fixture.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

using eps::testing::TestEngine;
using ::testing::HasSubstr;

TEST(BufferContractNamesTest, EveryContractBufferIsASharedBuffersMessageField) {
  for (const BufferSpec& spec : kBufferContract) {
    const google::protobuf::FieldDescriptor* field =
        v1::SharedBuffers::descriptor()->FindFieldByName(spec.name);
    ASSERT_NE(field, nullptr) << spec.name;
    EXPECT_EQ(field->message_type(), v1::MemoryDescriptor::descriptor()) << spec.name;
  }
  EXPECT_EQ(v1::SharedBuffers::descriptor()->field_count(), kSharedBuffers);
}

TEST_F(SessionServiceTest, ABlockTableOfOtherRowsNamesTheGroupTable) {
  v1::AttachRequest request = engine_.Attach("engine-a");
  request.mutable_buffers()->mutable_block_table()->set_shape(0, 1);
  v1::AttachResponse response;
  EXPECT_EQ(service_.Attach(request, &response).message(),
            "block_table.shape[0]=1 does not match group_table.shape[0]=2");
}

TEST_F(SessionServiceTest, VisitListsWiderThanTheBlockTableNameIt) {
  v1::AttachRequest request = engine_.Attach("engine-a");
  v1::MemoryDescriptor* visit = request.mutable_buffers()->mutable_visit_blocks();
  visit->set_shape(2, visit->shape(2) + 1);
  v1::AttachResponse response;
  EXPECT_THAT(service_.Attach(request, &response).message(),
              HasSubstr("visit_blocks.shape[2]=" + std::to_string(visit->shape(2)) +
                        " does not match block_table.shape[1]="));
}

TEST_F(SessionServiceTest, MaxSessionsRefusesANewEngineUntilOneDetaches) {
  ServerConfig two = config_;
  two.max_sessions = 2;
  SessionService service(two);
  v1::AttachResponse response;
  ASSERT_TRUE(service.Attach(engine_.Attach("engine-a"), &response).ok());
  ASSERT_TRUE(service.Attach(engine_.Attach("engine-b"), &response).ok());
  const std::string b_id = response.session_id();
  const absl::Status third = service.Attach(engine_.Attach("engine-c"), &response);
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.message(), HasSubstr("--max-sessions=2"));
  // Freed by a Detach, the place takes a new engine.
  v1::DetachRequest detach;
  detach.set_session_id(b_id);
  ASSERT_TRUE(service.Detach(detach).ok());
  EXPECT_TRUE(service.Attach(engine_.Attach("engine-c"), &response).ok());
}

TEST_F(SessionServiceTest, InlineListsNeedInlineCounts) {
  // Inline lists come back in the reply, as many blocks as visit_count says: counts in
  // memory the engine shares (and can rewrite) beside inline lists are refused, and the
  // other way round too.
  for (const bool inline_blocks : {true, false}) {
    SCOPED_TRACE(inline_blocks);
    v1::AttachRequest request = engine_.Attach("engine-a");
    v1::MemoryDescriptor* d = inline_blocks ? request.mutable_buffers()->mutable_visit_blocks()
                                            : request.mutable_buffers()->mutable_visit_count();
    d->mutable_inline_bytes()->set_data("");
    d->set_offset(0);
    request.mutable_buffers()->clear_flags();
    v1::AttachResponse response;
    const absl::Status s = service_.Attach(request, &response);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("visit_blocks and visit_count must both be inline_bytes"));
  }
}

TEST_F(SessionServiceTest, InlineListsThatCouldOutgrowAReplyAreRefusedAtAttach) {
  // The bound (session_buffers.h): every list at max_blocks ids of 5 bytes, 41 bytes of
  // fields a list, 1,024 for the reply's own. At the bound the session attaches and its
  // replies fit; one byte below, Attach names the flag (before, each step ran, then
  // failed to send, and used up its step number).
  v1::AttachRequest request = engine_.Attach("engine-a");
  InlineOutputs(request);
  request.mutable_options()->set_method(v1::METHOD_OFF);  // every block: the longest lists
  const v1::MemoryDescriptor& blocks = request.buffers().visit_blocks();
  ASSERT_EQ(blocks.shape_size(), 3);  // [layers, max_batch, max_blocks]: union lists
  const int64_t bound = blocks.shape(0) * blocks.shape(1) * (41 + 5 * blocks.shape(2)) + 1024;
  ServerConfig at = config_;
  at.max_message_bytes = static_cast<uint32_t>(bound);
  SessionService fits(at);
  v1::AttachResponse attached;
  ASSERT_TRUE(fits.Attach(request, &attached).ok());
  v1::SelectPagesResponse reply;
  ASSERT_TRUE(fits.SelectPages(Step(attached.session_id(), 1), &reply).ok());
  ASSERT_GT(reply.visit_lists_size(), 0);
  EXPECT_GT(reply.visit_lists(0).blocks_size(), 0);
  EXPECT_LE(static_cast<int64_t>(reply.ByteSizeLong()), bound);
  ServerConfig below = config_;
  below.max_message_bytes = static_cast<uint32_t>(bound - 1);
  SessionService refuses(below);
  v1::AttachResponse refused;
  const absl::Status s = refuses.Attach(request, &refused);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("more than --max-message-bytes=" + std::to_string(bound - 1)));
}

TEST_F(SessionServiceTest, PerLayerMassSettingsOfTheWrongCountOrRangeRefuseTheAttach) {
  v1::AttachRequest request = engine_.Attach("engine-a");
  request.set_backend(v1::BACKEND_CPU);
  SetMassOptions(PerLayerMassPolicy(), request.mutable_options());
  request.mutable_options()->mutable_mass_layers()->RemoveLast();
  v1::AttachResponse response;
  absl::Status s = service_.Attach(request, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "mass_layers has 1 settings, want one per layer (2) or none");

  request = engine_.Attach("engine-a");
  request.set_backend(v1::BACKEND_CPU);
  SetMassOptions(PerLayerMassPolicy(), request.mutable_options());
  request.mutable_options()->mutable_mass_layers(1)->set_min_pages(5);
  request.mutable_options()->mutable_mass_layers(1)->set_max_pages(2);
  s = service_.Attach(request, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "mass_layers[1].min_pages=5 exceeds mass_layers[1].max_pages=2");
}

TEST_F(SessionServiceTest, ACpuSessionNamingACudaDeviceIsInvalidArgument) {
  v1::AttachRequest by_ordinal = engine_.Attach("engine-a");
  by_ordinal.set_device(3);
  v1::AttachResponse response;
  absl::Status s = service_.Attach(by_ordinal, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("device=3 names a CUDA device"));

  v1::AttachRequest by_uuid = engine_.Attach("engine-b");
  by_uuid.set_device_uuid(std::string(16, '\x01'));
  s = service_.Attach(by_uuid, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("device_uuid"));
  EXPECT_EQ(service_.session_count(), 0u);
}

// Checked before epsd looks for a device, so these hold with or without one.
TEST_F(SessionServiceTest, ACudaSessionNamesOneDeviceForAllItsBuffers) {
  v1::AttachRequest split = engine_.Attach("engine-a");
  split.set_backend(v1::BACKEND_CUDA);
  split.mutable_buffers()->mutable_summary_pool()->mutable_cuda_ipc()->set_device(0);
  split.mutable_buffers()->mutable_queries()->mutable_cuda_ipc()->set_device(1);
  v1::AttachResponse response;
  absl::Status s = service_.Attach(split, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("buffers.queries.cuda_ipc.device=1 differs from the "
                                     "session's device 0"));

  v1::AttachRequest disagree = engine_.Attach("engine-b");
  disagree.set_backend(v1::BACKEND_CUDA);
  disagree.set_device(2);
  disagree.mutable_buffers()->mutable_summary_pool()->mutable_cuda_ipc()->set_device(1);
  s = service_.Attach(disagree, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(),
              HasSubstr("device=2 differs from buffers.summary_pool.cuda_ipc.device=1"));

  v1::AttachRequest negative = engine_.Attach("engine-c");
  negative.set_backend(v1::BACKEND_CUDA);
  negative.set_device(-1);
  s = service_.Attach(negative, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("device=-1 is negative"));

  v1::AttachRequest short_uuid = engine_.Attach("engine-d");
  short_uuid.set_backend(v1::BACKEND_CUDA);
  short_uuid.set_device_uuid("abcd");
  s = service_.Attach(short_uuid, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("device_uuid has 4 bytes, want 16"));
  EXPECT_EQ(service_.session_count(), 0u);
}

TEST_F(SessionServiceTest, CudaWithoutADeviceIsAFailedPrecondition) {
  if (CudaBackendBuilt() && CudaDevicePresent()) GTEST_SKIP() << "a CUDA device is present";
  v1::AttachRequest request = engine_.Attach("engine-a");
  request.set_backend(v1::BACKEND_CUDA);
  v1::AttachResponse response;
  const absl::Status s = service_.Attach(request, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("backend BACKEND_CUDA is not available"));
}

// A replacing Attach builds its session in the bytes of the session it replaces, which
// that one gives back once the Attach has retired it: an engine that restarts re-attaches
// at once with the server's budgets nearly full, not only after its old lease ran out,
// and the budgets still bound the server once the hand-over is done.
TEST(SessionBudgetTest, AnEngineReattachesAtOnceWhenTheServerBudgetsHoldOnlyItsSession) {
  const Peer user{.known = true, .uid = geteuid(), .pid = getpid()};
  TestEngine engine(eps::testing::SmallServiceModel(), /*max_seqs=*/2, /*max_context=*/512,
                    /*max_batch=*/2, eps::testing::TestSeed());
  uint64_t allocated = 0, mapped = 0;  // one session's charges
  {
    SessionService probe{ServerConfig{}};
    v1::AttachResponse attached;
    ASSERT_TRUE(probe.Attach(engine.Attach("engine-a"), &attached, user).ok());
    allocated = probe.charged_bytes();
    mapped = probe.mapped_bytes();
  }
  ASSERT_GT(allocated, 0u);
  ASSERT_GT(mapped, 0u);
  for (const bool bound_mapped : {false, true}) {
    const char* flag = bound_mapped ? "--max-server-mapped-bytes" : "--max-server-bytes";
    SCOPED_TRACE(flag);
    ServerConfig config;
    // Room for one session and half of another.
    if (bound_mapped) {
      config.max_server_mapped_bytes = mapped + mapped / 2;
    } else {
      config.max_server_bytes = allocated + allocated / 2;
    }
    SessionService service(config);
    v1::AttachResponse first, second, third, other;
    ASSERT_TRUE(service.Attach(engine.Attach("engine-a"), &first, user).ok());
    const absl::Status again = service.Attach(engine.Attach("engine-a"), &second, user);
    ASSERT_TRUE(again.ok()) << again;
    EXPECT_NE(second.session_id(), first.session_id());
    // The old session gave its bytes back: one session's charges are held.
    EXPECT_EQ(service.charged_bytes(), allocated);
    EXPECT_EQ(service.mapped_bytes(), mapped);
    // Another engine gets no such room.
    const absl::Status b = service.Attach(engine.Attach("engine-b"), &other, user);
    EXPECT_EQ(b.code(), absl::StatusCode::kResourceExhausted) << b;
    EXPECT_THAT(b.message(), HasSubstr(flag));
    EXPECT_EQ(service.charged_bytes(), allocated);
    ASSERT_TRUE(service.Attach(engine.Attach("engine-a"), &third, user).ok());
    EXPECT_EQ(service.session_count(), 1u);
  }
}

// Over TCP an Attach naming a live session's engine_id is refused (ALREADY_EXISTS). It
// was refused only when it published, after it had built a whole session in the live
// one's bytes (the replacing Attach's allowance): a loop of such calls kept the server's
// budget over its limit, and another engine's Attach that fitted was refused
// RESOURCE_EXHAUSTED (6107 of 6140 tries). The refused call now builds nothing.
TEST(SessionBudgetTest, AnAttachRefusedOverTcpBuildsNothingSoAnotherEngineStillFits) {
  const Peer tcp;          // a caller of unknown credentials
  uint64_t allocated = 0;  // one session's charges
  {
    SessionService probe{fuzz::FuzzConfig()};
    v1::AttachResponse attached;
    ASSERT_TRUE(probe.Attach(fuzz::SmallInlineAttach("engine-a"), &attached, tcp).ok());
    allocated = probe.charged_bytes();
  }
  ASSERT_GT(allocated, 0u);
  ServerConfig config = fuzz::FuzzConfig();
  config.max_server_bytes = 2 * allocated + allocated / 2;  // two sessions, not three
  // The second build of engine-a (the refused Attach, if it builds) holds its charges
  // until the test has attached engine-b; 10 s at most, should nothing release it.
  std::atomic<int> builds_of_a{0};
  absl::Notification second_build_of_a, release;
  BackendFactory make_backend = [&](const SessionSpec& spec, const SessionBuffers& buffers,
                                    const ServerConfig& server,
                                    std::unique_ptr<StepBackend>* remains) {
    if (spec.engine_id == "engine-a" && builds_of_a.fetch_add(1) == 1) {
      second_build_of_a.Notify();
      release.WaitForNotificationWithTimeout(absl::Seconds(10));
    }
    return MakeSessionBackend(spec, buffers, server, remains);
  };
  SessionService service(config, nullptr, make_backend);
  v1::AttachResponse owner, taken, other;
  ASSERT_TRUE(service.Attach(fuzz::SmallInlineAttach("engine-a"), &owner, tcp).ok());
  absl::Status refused;
  absl::Notification refused_done;
  std::thread attacker([&] {
    refused = service.Attach(fuzz::SmallInlineAttach("engine-a"), &taken, tcp);
    refused_done.Notify();
  });
  while (!refused_done.HasBeenNotified() && !second_build_of_a.HasBeenNotified()) {
    std::this_thread::yield();
  }
  const absl::Status fits = service.Attach(fuzz::SmallInlineAttach("engine-b"), &other, tcp);
  release.Notify();
  attacker.join();
  EXPECT_EQ(refused.code(), absl::StatusCode::kAlreadyExists) << refused;
  EXPECT_TRUE(fits.ok()) << fits;
  EXPECT_EQ(builds_of_a.load(), 1);  // the refused Attach built nothing
  EXPECT_EQ(service.charged_bytes(), 2 * allocated);
}

}  // namespace
}  // namespace eps::service
