// Backend faults as the session service meets them, with stand-in backends that fail
// on command, which no backend on a CPU-only machine can (tests/gpu/device_lost_test.cc
// shows the cuda backend's statuses carry the device-lost mark when a real context is
// lost).
//
// A failed backend's allocations (SessionBackendRemainsTest): an Attach whose backend
// fails after allocating device memory answers its error at once, and what was
// allocated is destroyed by the session janitor once that is safe, never on the
// Attach's thread (freeing may wait for another engine's queued step:
// service/session_janitor.h).
//
// A lost CUDA device (a status marked by core/status.h MarkDeviceLost): the handler runs
// once, with the first such status, whichever call found it; the call that found it
// answers with its own error, and from then on every Attach and step is UNAVAILABLE.
// Ordinary failures do neither. How epsd's whole process ends on such faults (exit 1,
// the drain's backstop) is in backend_fault_exit_test.cc.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "service/config.h"
#include "service/cpu_backend.h"
#include "service/server.h"
#include "service/session.h"
#include "service/session_service.h"
#include "tests/core/test_util.h"
#include "tests/service/forwarding_backend.h"
#include "tests/service/loopback_server.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

using eps::testing::TestEngine;

// Polls `done` for up to 10 s (a loaded machine); true when it held.
template <typename F>
bool Eventually(F done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

absl::Status Lost() {
  return MarkDeviceLost(absl::InternalError("cudaStreamQuery: an illegal memory access"));
}

// What the stand-in does at its next Run.
enum class Fault {
  kNone,
  kLoseNow,
  kLoseInEarlier,
  kOrdinary,
  kFailAfterFinishingEarlier,
  kSaturatedBytes,
  kThrow,         // a bug: CallGuarded (service/call_guard.h) turns it into INTERNAL
  kLoseAtRetire,  // the session's end finds its queued async step met a lost device
};

// The cpu backend, or a lost device when `fault` says so: in the step's own status
// (a sync step's Finish), or in a finished async step reported with a later one.
class LossyBackend final : public ForwardingBackend {
 public:
  LossyBackend(std::unique_ptr<StepBackend> inner, std::atomic<Fault>* fault)
      : ForwardingBackend(std::move(inner)), fault_(fault) {}
  absl::Status Run(const BackendStep& step, StepOutcome* outcome) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    switch (fault_->load()) {
      case Fault::kLoseNow:
        return Lost();
      case Fault::kOrdinary:
        return absl::InternalError("cudaMemcpyAsync: invalid argument");
      case Fault::kLoseInEarlier:
        outcome->earlier.emplace_back().step = step.step - 1;
        outcome->earlier.back().status = Lost();
        break;
      case Fault::kFailAfterFinishingEarlier:  // as the cuda backend's checks after Finish
        outcome->earlier.emplace_back().step = step.step - 1;
        outcome->earlier.back().stats.groups_total = 7;
        return absl::FailedPreconditionError("step is not after selection_done");
      case Fault::kThrow:
        throw std::runtime_error("a bug in the backend");
      case Fault::kNone:
      case Fault::kSaturatedBytes:
      case Fault::kLoseAtRetire:
        break;
    }
    const absl::Status s = RunInner(step, outcome);
    if (fault_->load() == Fault::kSaturatedBytes) {  // a step of a 2^35-token context
      outcome->stats.kv_bytes_dense = std::numeric_limits<int64_t>::max();
    }
    return s;
  }

 protected:
  // The cuda backend's Finish of a step that hit an illegal address: a sticky error.
  absl::Status FinishQueued(bool) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    return fault_->load() == Fault::kLoseAtRetire ? Lost() : absl::OkStatus();
  }

 private:
  std::atomic<Fault>* fault_;
};

class DeviceLostTest : public ::testing::Test {
 protected:
  DeviceLostTest()
      : engine_(eps::testing::SmallServiceModel(), /*max_seqs=*/2, /*max_context=*/512,
                /*max_batch=*/2, eps::testing::TestSeed()) {
    engine_.Fill(0, 0, 300);
    engine_.Fill(1, 1, 200);
  }

  std::string Attach(const std::string& engine_id) {
    v1::AttachResponse response;
    const absl::Status s = service_.Attach(engine_.Attach(engine_id), &response);
    EXPECT_TRUE(s.ok()) << s;
    return response.session_id();
  }
  absl::Status Step(const std::string& session, uint64_t step) {
    v1::SelectPagesResponse response;
    return service_.SelectPages(TestEngine::Step(session, step, rows_), &response);
  }
  int handled() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(seen_.size());
  }

  TestEngine engine_;
  std::atomic<Fault> fault_{Fault::kNone};
  std::atomic<bool> lose_at_attach_{false};
  std::atomic<bool> throw_at_attach_{false};
  absl::Mutex mu_;
  std::vector<absl::Status> seen_;  // what the handler was called with
  ServerConfig config_;
  SessionService service_{
      config_,
      [this](const absl::Status& s) {
        absl::MutexLock lock(&mu_);
        seen_.push_back(s);
      },
      [this](const SessionSpec& spec, const SessionBuffers&, const ServerConfig&,
             std::unique_ptr<StepBackend>*) -> absl::StatusOr<std::unique_ptr<StepBackend>> {
        if (lose_at_attach_.load()) return Lost();
        if (throw_at_attach_.load()) throw std::runtime_error("a bug in the backend factory");
        ASSIGN_OR_RETURN(std::unique_ptr<StepBackend> cpu, MakeCpuBackend(spec.model));
        return std::unique_ptr<StepBackend>(new LossyBackend(std::move(cpu), &fault_));
      }};
  const std::vector<v1::BatchRow> rows_ = {TestEngine::Row(0, 300), TestEngine::Row(1, 200)};
};

TEST_F(DeviceLostTest, AStepThatLosesTheDeviceCallsTheHandlerOnceAndEveryLaterCallIsUnavailable) {
  const std::string a = Attach("engine-a"), b = Attach("engine-b");
  ASSERT_TRUE(Step(a, 1).ok());
  ASSERT_TRUE(Step(b, 1).ok());
  EXPECT_EQ(handled(), 0);

  fault_ = Fault::kLoseNow;
  const absl::Status first = Step(a, 2);
  EXPECT_EQ(first.code(), absl::StatusCode::kInternal) << first;
  EXPECT_NE(first.message().find("illegal memory access"), std::string_view::npos) << first;
  ASSERT_EQ(handled(), 1);
  {
    absl::MutexLock lock(&mu_);
    EXPECT_TRUE(IsDeviceLost(seen_[0])) << seen_[0];
  }
  // Any later step, of any engine: UNAVAILABLE (re-attach to the next epsd), no second call.
  EXPECT_EQ(Step(a, 3).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Step(b, 2).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(handled(), 1);

  // No new session on a process that is going away; the attached ones may still detach.
  v1::AttachResponse response;
  const absl::Status attach = service_.Attach(engine_.Attach("engine-c"), &response);
  EXPECT_EQ(attach.code(), absl::StatusCode::kUnavailable) << attach;
  EXPECT_NE(attach.message().find("restarting"), std::string_view::npos) << attach;
  EXPECT_TRUE(response.session_id().empty());
  v1::DetachRequest detach;
  detach.set_session_id(a);
  EXPECT_TRUE(service_.Detach(detach).ok());
}

// An async step's device-side outcome comes back with the session's next call: a lost
// device there counts the same, though the next step itself ran.
TEST_F(DeviceLostTest, ALostDeviceInAnEarlierStepsOutcomeCallsTheHandler) {
  const std::string a = Attach("engine-a");
  ASSERT_TRUE(Step(a, 1).ok());
  fault_ = Fault::kLoseInEarlier;
  v1::SelectPagesResponse response;
  ASSERT_TRUE(service_.SelectPages(TestEngine::Step(a, 2, rows_), &response).ok());
  ASSERT_EQ(response.earlier_size(), 1);
  EXPECT_NE(response.earlier(0).error().find("illegal memory access"), std::string::npos);
  EXPECT_EQ(handled(), 1);
  v1::AttachResponse attached;
  EXPECT_EQ(service_.Attach(engine_.Attach("engine-b"), &attached).code(),
            absl::StatusCode::kUnavailable);
  fault_ = Fault::kNone;
  EXPECT_EQ(Step(a, 3).code(), absl::StatusCode::kUnavailable);
}

TEST_F(DeviceLostTest, AnAttachThatLosesTheDeviceCallsTheHandler) {
  lose_at_attach_ = true;
  v1::AttachResponse response;
  EXPECT_EQ(service_.Attach(engine_.Attach("engine-a"), &response).code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(handled(), 1);
  lose_at_attach_ = false;  // a device that came back would still not be trusted
  EXPECT_EQ(service_.Attach(engine_.Attach("engine-b"), &response).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(handled(), 1);
}

// A session's end finishes its queued async step (StepBackend::Retire); a lost device found
// there counts as one found by a step, whoever ended the session. It was only printed, and
// epsd went on serving on a dead context until an unrelated call touched CUDA.
TEST_F(DeviceLostTest, ADetachWhoseQueuedStepFindsTheDeviceLostCallsTheHandler) {
  const std::string a = Attach("engine-a");
  ASSERT_TRUE(Step(a, 1).ok());
  fault_ = Fault::kLoseAtRetire;
  v1::DetachRequest detach;
  detach.set_session_id(a);
  EXPECT_TRUE(service_.Detach(detach).ok());  // the session has ended all the same
  ASSERT_EQ(handled(), 1);
  {
    absl::MutexLock lock(&mu_);
    EXPECT_TRUE(IsDeviceLost(seen_[0])) << seen_[0];
  }
  v1::AttachResponse response;
  EXPECT_EQ(service_.Attach(engine_.Attach("engine-b"), &response).code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(DeviceLostTest, AnExpiryWhoseQueuedStepFindsTheDeviceLostCallsTheHandler) {
  v1::AttachRequest request = engine_.Attach("engine-a");
  request.set_lease_ms(50);  // the reaper looks every 10 ms or more often
  v1::AttachResponse attached;
  ASSERT_TRUE(service_.Attach(request, &attached).ok());
  ASSERT_TRUE(Step(attached.session_id(), 1).ok());
  fault_ = Fault::kLoseAtRetire;
  EXPECT_TRUE(Eventually([&] { return handled() == 1; }));
  EXPECT_EQ(service_.session_count(), 0u);
  v1::AttachResponse response;
  EXPECT_EQ(service_.Attach(engine_.Attach("engine-b"), &response).code(),
            absl::StatusCode::kUnavailable);
}

// The replaced session's step ends before the new one is granted; a lost device found
// there leaves the new session of no use, so the Attach itself is refused as restarting.
TEST_F(DeviceLostTest, AReplacingAttachWhoseOldStepFindsTheDeviceLostIsRefusedAsRestarting) {
  // A caller of a known user replaces its engine's live session (one over TCP may not).
  const Peer engine{.known = true, .uid = getuid(), .pid = getpid()};
  v1::AttachResponse attached;
  ASSERT_TRUE(service_.Attach(engine_.Attach("engine-a"), &attached, engine).ok());
  v1::SelectPagesResponse stepped;
  ASSERT_TRUE(service_
                  .SelectPages(TestEngine::Step(attached.session_id(), 1, rows_), &stepped, nullptr,
                               {}, engine)
                  .ok());
  fault_ = Fault::kLoseAtRetire;
  v1::AttachResponse response;
  const absl::Status again = service_.Attach(engine_.Attach("engine-a"), &response, engine);
  EXPECT_EQ(again.code(), absl::StatusCode::kUnavailable) << again;
  EXPECT_NE(again.message().find("restarting"), std::string_view::npos) << again;
  EXPECT_TRUE(response.session_id().empty());
  EXPECT_EQ(handled(), 1);
  EXPECT_EQ(service_.session_count(), 0u);
}

// An ordinary CUDA error fails its step and nothing else.
TEST_F(DeviceLostTest, AnOrdinaryErrorNeitherCallsTheHandlerNorEndsAttaches) {
  const std::string a = Attach("engine-a");
  fault_ = Fault::kOrdinary;
  EXPECT_EQ(Step(a, 1).code(), absl::StatusCode::kInternal);
  fault_ = Fault::kNone;
  EXPECT_TRUE(Step(a, 2).ok());
  EXPECT_EQ(handled(), 0);
  EXPECT_FALSE(Attach("engine-b").empty());
}

// A call that finishes the session's queued async step and then fails sends no reply
// (grpc_service.cc clears it), so that step's statistics come with the next reply that
// is sent, once.
using EarlierStepsTest = DeviceLostTest;
TEST_F(EarlierStepsTest, AStepFinishedByAFailedCallComesWithTheNextSuccessfulReply) {
  const std::string a = Attach("engine-a");
  ASSERT_TRUE(Step(a, 1).ok());
  fault_ = Fault::kFailAfterFinishingEarlier;
  v1::SelectPagesResponse failed;
  const absl::Status s = service_.SelectPages(TestEngine::Step(a, 2, rows_), &failed);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_EQ(failed.earlier_size(), 0);  // not in a reply that is never sent
  fault_ = Fault::kOrdinary;
  EXPECT_EQ(Step(a, 2).code(), absl::StatusCode::kInternal);
  fault_ = Fault::kNone;
  v1::SelectPagesResponse next;
  ASSERT_TRUE(service_.SelectPages(TestEngine::Step(a, 2, rows_), &next).ok());
  ASSERT_EQ(next.earlier_size(), 1);
  EXPECT_EQ(next.earlier(0).step(), 1u);
  EXPECT_EQ(next.earlier(0).groups_total(), 7);
  EXPECT_TRUE(next.earlier(0).error().empty()) << next.earlier(0).error();
  v1::SelectPagesResponse after;
  ASSERT_TRUE(service_.SelectPages(TestEngine::Step(a, 3, rows_), &after).ok());
  EXPECT_EQ(after.earlier_size(), 0);  // delivered once
}

// A step's byte counts stop at INT64_MAX (core/saturating.h); the session's totals did not,
// and went negative on the next step.
TEST_F(DeviceLostTest, TheSessionsByteTotalsStopAtTheTopToo) {
  const std::string a = Attach("engine-a");
  fault_ = Fault::kSaturatedBytes;
  ASSERT_TRUE(Step(a, 1).ok());
  ASSERT_TRUE(Step(a, 2).ok());
  fault_ = Fault::kNone;
  v1::GetStatsRequest request;
  request.set_session_id(a);
  v1::GetStatsResponse stats;
  ASSERT_TRUE(service_.GetStats(request, &stats).ok());
  ASSERT_EQ(stats.sessions_size(), 1);
  EXPECT_EQ(stats.sessions(0).bytes_kv_dense(), std::numeric_limits<int64_t>::max());
}

// The same through the gRPC server epsd runs: the server's fatal hook is called once
// and fatal() names the error (epsd's main then drains and exits 1), and the engines
// see INTERNAL for the step that met it and UNAVAILABLE for every later call.
TEST(ServerDeviceLostTest, ALostDeviceCallsTheFatalHookOnceAndLaterCallsAreUnavailable) {
  std::atomic<Fault> fault{Fault::kNone};
  std::atomic<int> fatal_calls{0};
  const std::string path = absl::StrCat("/tmp/epsd-test-fault-", getpid(), ".sock");
  // After the server (declared below it): epsd keeps the lock file (service/unix_socket.h).
  absl::Cleanup remove_lock = [&] { unlink((path + ".lock").c_str()); };
  ServerHooks hooks{.on_fatal = [&] { fatal_calls.fetch_add(1); },
                    .make_backend = WrapCpuBackend<LossyBackend>(&fault),
                    .step_log = nullptr};
  absl::StatusOr<LoopbackServer> epsd =
      StartLoopbackServer({"--listen=unix://" + path, "--metrics-listen=off"}, std::move(hooks));
  ASSERT_TRUE(epsd.ok()) << epsd.status();
  EpsServer& server = *epsd->server;
  v1::PageSelector::Stub* stub = epsd->stub.get();
  TestEngine engine(eps::testing::SmallServiceModel(), 2, 512, 2, eps::testing::TestSeed());
  engine.Fill(0, 0, 300);
  const std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 300)};
  auto call = [](auto method) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return method(&context);
  };
  v1::AttachResponse attached;
  ASSERT_TRUE(call([&](grpc::ClientContext* c) {
                return stub->Attach(c, engine.Attach("engine-a"), &attached);
              }).ok());
  v1::SelectPagesResponse reply;
  const auto step = [&](uint64_t n) {
    return call([&](grpc::ClientContext* c) {
      return stub->SelectPages(c, TestEngine::Step(attached.session_id(), n, rows), &reply);
    });
  };
  ASSERT_TRUE(step(1).ok());
  EXPECT_EQ(fatal_calls.load(), 0);
  EXPECT_TRUE(server.fatal().ok());

  fault = Fault::kLoseNow;
  const grpc::Status lost = step(2);
  EXPECT_EQ(lost.error_code(), grpc::StatusCode::INTERNAL) << lost.error_message();
  EXPECT_EQ(step(3).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(fatal_calls.load(), 1);
  EXPECT_TRUE(IsDeviceLost(server.fatal())) << server.fatal();
  v1::AttachResponse refused;
  const grpc::Status again = call(
      [&](grpc::ClientContext* c) { return stub->Attach(c, engine.Attach("engine-b"), &refused); });
  EXPECT_EQ(again.error_code(), grpc::StatusCode::UNAVAILABLE) << again.error_message();
}

// What a failed cuda backend leaves (MakeCudaBackend's remains): it frees device
// memory when destroyed, which is safe only when `safe` says so.
class Remains final : public StepBackend {
 public:
  Remains(std::atomic<bool>* safe, std::atomic<std::thread::id>* destroyed_on)
      : safe_(safe), destroyed_on_(destroyed_on) {}
  ~Remains() override { destroyed_on_->store(std::this_thread::get_id()); }
  BackendKind kind() const override { return BackendKind::kCuda; }
  bool frees_device_memory() const override { return true; }
  bool SafeToDestroy(std::chrono::steady_clock::duration) const override { return safe_->load(); }
  absl::Status Run(const BackendStep&, StepOutcome*) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    return absl::InternalError("never run");
  }

 private:
  std::atomic<bool>* safe_;
  std::atomic<std::thread::id>* destroyed_on_;
};

// A call that failed inside epsd (an exception, answered INTERNAL) is a failed call:
// validation_failures_total counts every failed call but those whose client gave up
// (docs/api.md), and once missed the SelectPages and Attach calls that threw.
using ThrowingCallTest = DeviceLostTest;

TEST_F(ThrowingCallTest, AStepWhoseBackendThrowsIsInternalAndCountedAsAFailedCall) {
  const std::string a = Attach("engine-a");
  ASSERT_TRUE(Step(a, 1).ok());
  fault_ = Fault::kThrow;
  const absl::Status s = Step(a, 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("SelectPages: epsd failed: a bug in the backend"),
            std::string_view::npos)
      << s;
  v1::GetStatsResponse stats;
  ASSERT_TRUE(service_.GetStats({}, &stats).ok());
  EXPECT_EQ(stats.validation_failures_total(), 1u);
  EXPECT_EQ(handled(), 0);  // no device lost
  fault_ = Fault::kNone;
  EXPECT_TRUE(Step(a, 3).ok());  // the session's step lock was let go
}

TEST_F(ThrowingCallTest, AnAttachWhoseBackendFactoryThrowsIsInternalAndCountedAsAFailedCall) {
  throw_at_attach_ = true;
  v1::AttachResponse response;
  const absl::Status s = service_.Attach(engine_.Attach("engine-a"), &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("Attach: epsd failed: a bug in the backend factory"),
            std::string_view::npos)
      << s;
  EXPECT_EQ(service_.session_count(), 0u);
  v1::GetStatsResponse stats;
  ASSERT_TRUE(service_.GetStats({}, &stats).ok());
  EXPECT_EQ(stats.validation_failures_total(), 1u);
}

TEST(SessionBackendRemainsTest, AFailedBackendsAllocationsAreFreedByTheJanitorOnceSafe) {
  TestEngine engine(eps::testing::SmallServiceModel(), 2, 512, 2, eps::testing::TestSeed());
  std::atomic<bool> safe{false};
  std::atomic<std::thread::id> destroyed_on{std::thread::id()};
  ServerConfig config;
  SessionService service(
      config, nullptr,
      [&](const SessionSpec&, const SessionBuffers&, const ServerConfig&,
          std::unique_ptr<StepBackend>* remains) -> absl::StatusOr<std::unique_ptr<StepBackend>> {
        *remains = std::make_unique<Remains>(&safe, &destroyed_on);
        return absl::ResourceExhaustedError("cudaMalloc(1073741824 bytes): out of memory");
      });
  const uint64_t charged_before = service.charged_bytes();
  v1::AttachResponse response;
  const absl::Status s = service.Attach(engine.Attach("engine-a"), &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(response.session_id().empty());
  EXPECT_EQ(service.session_count(), 0u);
  // Not freed on the Attach's thread, and still charged while it waits.
  EXPECT_EQ(destroyed_on.load(), std::thread::id());
  EXPECT_EQ(service.sessions_ending(), 1u);
  EXPECT_GT(service.charged_bytes(), charged_before);
  safe = true;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (service.sessions_ending() != 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(service.sessions_ending(), 0u);
  EXPECT_NE(destroyed_on.load(), std::thread::id());
  EXPECT_NE(destroyed_on.load(), std::this_thread::get_id());
  EXPECT_EQ(service.charged_bytes(), charged_before);
}

}  // namespace
}  // namespace eps::service
