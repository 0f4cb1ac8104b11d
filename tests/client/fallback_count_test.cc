// Hardening, class 6 (C++ client): each fallback is counted once by epsd. A
// step that misses its deadline may still reach epsd, so its report can arrive
// twice; repeated misses once made epsd count the same fallbacks again and
// again. A fake epsd slows the first steps past the client's deadline, records
// every report it receives, and feeds them to epsd's own accounting.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "client/cpp/eps_client.h"
#include "eps/v1/page_selector.grpc.pb.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "service/telemetry/fallback_reports.h"

namespace eps {
namespace {

// A fake epsd serving `service` on `target`.
std::unique_ptr<grpc::Server> Serve(grpc::Service* service, const std::string& target) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(target, grpc::InsecureServerCredentials());
  builder.RegisterService(service);
  return builder.BuildAndStart();
}

// A fake epsd whose Attach grants "s-fake" at once.
class GrantsAtOnce : public v1::PageSelector::CallbackService {
 public:
  grpc::ServerUnaryReactor* Attach(grpc::CallbackServerContext* context, const v1::AttachRequest*,
                                   v1::AttachResponse* response) override {
    response->set_session_id("s-fake");
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

class SlowFirstSteps final : public GrantsAtOnce {
 public:
  explicit SlowFirstSteps(uint64_t slow_steps) : slow_steps_(slow_steps) {}

  grpc::ServerUnaryReactor* SelectPages(grpc::CallbackServerContext* context,
                                        const v1::SelectPagesRequest* request,
                                        v1::SelectPagesResponse* response) override {
    {
      std::lock_guard lock(mu_);
      if (request->has_fallbacks()) reports_.push_back(request->fallbacks());
    }
    // Far past the client's 2 ms: the step reached epsd, yet the client falls back.
    if (request->step() <= slow_steps_) std::this_thread::sleep_for(std::chrono::milliseconds(30));
    response->set_step(request->step());
    response->set_done(true);  // a sync reply: the outputs are written
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  std::vector<v1::ClientFallbacks> reports() {
    std::lock_guard lock(mu_);
    return reports_;
  }

 private:
  const uint64_t slow_steps_;
  std::mutex mu_;
  std::vector<v1::ClientFallbacks> reports_;
};

TEST(FallbackCounting, RepeatedDeadlineMissesAreEachCountedOnceByEpsd) {
  constexpr uint64_t kMisses = 8;
  SlowFirstSteps fake(kMisses);
  const std::string target = "unix:///tmp/eps-fake-" + std::to_string(getpid()) + ".sock";
  std::unique_ptr<grpc::Server> server = Serve(&fake, target);
  ASSERT_NE(server, nullptr);

  client::ClientOptions options;
  options.target = target;
  options.deadline = std::chrono::milliseconds(2);
  options.attach_deadline = std::chrono::seconds(5);
  v1::AttachRequest attach;
  attach.set_engine_id("engine-fallbacks");
  {
    client::EpsClient client(options, attach);
    ASSERT_TRUE(client.Attach().ok());
    v1::BatchRow row;
    row.set_context_tokens(16);
    for (uint64_t step = 1; step <= kMisses; ++step) {
      EXPECT_TRUE(client.SelectPages(step, {&row, 1}).fallback);
    }
    // A prompt step carries the final report; retry a few times on a loaded machine.
    bool selected = false;
    for (uint64_t step = kMisses + 1; step < kMisses + 50 && !selected; ++step) {
      selected = !client.SelectPages(step, {&row, 1}).fallback;
    }
    ASSERT_TRUE(selected);
    ASSERT_EQ(client.counters().fallback_deadline, client.counters().fallbacks());
  }
  // What epsd's eps_client_fallbacks_total{reason="deadline"} adds up from these reports.
  telemetry::FallbackReports accounting;
  uint64_t counted = 0;
  const std::vector<v1::ClientFallbacks> reports = fake.reports();
  ASSERT_FALSE(reports.empty());
  for (const v1::ClientFallbacks& report : reports) counted += accounting.Increase(report)[0];
  uint64_t local = 0;
  for (const v1::ClientFallbacks& report : reports) local = std::max(local, report.deadline());
  EXPECT_GE(local, kMisses);
  EXPECT_EQ(counted, local) << reports.size() << " reports received";
  server->Shutdown();
}

// Answers every step with another step's number.
class WrongStep final : public GrantsAtOnce {
 public:
  grpc::ServerUnaryReactor* SelectPages(grpc::CallbackServerContext* context,
                                        const v1::SelectPagesRequest* request,
                                        v1::SelectPagesResponse* response) override {
    response->set_step(request->step() + 1000);
    response->set_done(true);
    auto* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

TEST(FallbackCounting, AReplyForAnotherStepIsAnErrorFallback) {
  WrongStep fake;
  const std::string target = "unix:///tmp/eps-fake-step-" + std::to_string(getpid()) + ".sock";
  std::unique_ptr<grpc::Server> server = Serve(&fake, target);
  ASSERT_NE(server, nullptr);
  client::ClientOptions options;
  options.target = target;
  options.deadline = std::chrono::seconds(2);
  options.attach_deadline = std::chrono::seconds(5);
  v1::AttachRequest attach;
  attach.set_engine_id("engine-wrong-step");
  {
    client::EpsClient client(options, attach);
    ASSERT_TRUE(client.Attach().ok());
    v1::BatchRow row;
    row.set_context_tokens(16);
    const client::StepResult r = client.SelectPages(7, {&row, 1});
    EXPECT_TRUE(r.fallback);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInternal) << r.status;
    EXPECT_NE(r.status.message().find("epsd answered step 1007 for step 7"), std::string::npos)
        << r.status;
    EXPECT_EQ(client.counters().fallback_error, 1u);
    EXPECT_EQ(client.counters().selected, 0u);
  }
  server->Shutdown();
}

// Grants sessions slowly (`attach_delay`) and records which it granted and which were
// detached.
class SlowAttach final : public v1::PageSelector::Service {
 public:
  explicit SlowAttach(std::chrono::milliseconds attach_delay) : delay_(attach_delay) {}
  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest*,
                      v1::AttachResponse* response) override {
    std::this_thread::sleep_for(delay_);
    std::lock_guard lock(mu_);
    response->set_session_id("s-" + std::to_string(granted_.size() + 1));
    granted_.push_back(response->session_id());
    return grpc::Status::OK;
  }
  grpc::Status Detach(grpc::ServerContext*, const v1::DetachRequest* request,
                      v1::DetachResponse*) override {
    std::lock_guard lock(mu_);
    detached_.push_back(request->session_id());
    return grpc::Status::OK;
  }
  std::vector<std::string> granted() {
    std::lock_guard lock(mu_);
    return granted_;
  }
  std::vector<std::string> detached() {
    std::lock_guard lock(mu_);
    return detached_;
  }

 private:
  const std::chrono::milliseconds delay_;
  std::mutex mu_;
  std::vector<std::string> granted_, detached_;
};

TEST(ClientLifecycle, DetachAlsoEndsASessionABackgroundReattachIsBeingGranted) {
  // A step with no session starts a background Attach and falls back; a Detach right after
  // used to find no session id and return, and the session granted a moment later stayed
  // on epsd (its buffers mapped) until its lease ran out.
  SlowAttach fake(std::chrono::milliseconds(200));
  const std::string target = "unix:///tmp/eps-fake-detach-" + std::to_string(getpid()) + ".sock";
  std::unique_ptr<grpc::Server> server = Serve(&fake, target);
  ASSERT_NE(server, nullptr);
  client::ClientOptions options;
  options.target = target;
  options.attach_deadline = std::chrono::seconds(5);
  v1::AttachRequest attach;
  attach.set_engine_id("engine-detach");
  {
    client::EpsClient client(options, attach);
    v1::BatchRow row;
    row.set_context_tokens(16);
    EXPECT_TRUE(client.SelectPages(1, {&row, 1}).fallback);  // not attached: re-attach starts
    EXPECT_TRUE(client.Detach().ok());
  }
  EXPECT_EQ(fake.granted(), std::vector<std::string>{"s-1"});
  EXPECT_EQ(fake.detached(), std::vector<std::string>{"s-1"});
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

TEST(ClientLifecycle, DestroyingAClientDoesNotWaitOutAStalledReattach) {
  // The background Attach hangs (a stopped epsd); the destructor cancels it instead of
  // waiting out attach_deadline (10 s here). A hang guard, not a latency target.
  SlowAttach fake(std::chrono::seconds(3));
  const std::string target = "unix:///tmp/eps-fake-stall-" + std::to_string(getpid()) + ".sock";
  std::unique_ptr<grpc::Server> server = Serve(&fake, target);
  ASSERT_NE(server, nullptr);
  client::ClientOptions options;
  options.target = target;
  options.attach_deadline = std::chrono::seconds(10);
  v1::AttachRequest attach;
  attach.set_engine_id("engine-stall");
  auto client = std::make_unique<client::EpsClient>(options, attach);
  v1::BatchRow row;
  row.set_context_tokens(16);
  EXPECT_TRUE(client->SelectPages(1, {&row, 1}).fallback);      // the re-attach starts
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // and reaches the server
  const auto start = std::chrono::steady_clock::now();
  client.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

TEST(FallbackCounting, EpsdAddsOnlyTheIncreaseOfAClientsTotals) {
  telemetry::FallbackReports accounting;
  v1::ClientFallbacks report;
  report.set_client_id(42);
  report.set_deadline(3);
  EXPECT_EQ(accounting.Increase(report)[0], 3u);
  EXPECT_EQ(accounting.Increase(report)[0], 0u);  // the same report again
  report.set_deadline(5);
  report.set_error(1);
  EXPECT_EQ(accounting.Increase(report)[0], 2u);
  report.set_deadline(4);  // an older report, late
  EXPECT_EQ(accounting.Increase(report)[0], 0u);
  v1::ClientFallbacks other = report;
  other.set_client_id(43);  // another client's totals are its own
  EXPECT_EQ(accounting.Increase(other)[0], 4u);
  v1::ClientFallbacks deltas;  // no client_id: deltas, added as they come
  deltas.set_deadline(2);
  EXPECT_EQ(accounting.Increase(deltas)[0], 2u);
  EXPECT_EQ(accounting.Increase(deltas)[0], 2u);
}

}  // namespace
}  // namespace eps
