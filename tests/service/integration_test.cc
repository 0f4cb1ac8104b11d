// Integration tests: the real epsd binary, the C++ client, shared memory, and
// every output checked against the core/ reference on the same buffers.
#include <cmath>
#include <thread>
#include <vector>

#include "client/cpp/eps_client.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/service/epsd_process.h"
#include "tests/service/test_engine.h"

namespace eps {
namespace {

using testing::EpsdProcess;
using testing::TestEngine;

client::ClientOptions Options(const std::string& target, bool stream = false) {
  client::ClientOptions o;
  o.target = target;
  o.deadline = std::chrono::milliseconds(2000);  // generous: CI machines are slow and shared
  o.attach_deadline = std::chrono::seconds(5);   // likewise (the default is 500 ms)
  o.use_stream = stream;
  return o;
}

void RunSteps(client::EpsClient& client, TestEngine& engine, int steps, int64_t base_tokens) {
  for (int step = 1; step <= steps; ++step) {
    std::vector<v1::BatchRow> rows = {TestEngine::Row(0, base_tokens + step),
                                      TestEngine::Row(1, base_tokens / 2 + step)};
    const client::StepResult r = client.SelectPages(step, rows);
    ASSERT_FALSE(r.fallback) << "step " << step << ": " << r.status;
    ASSERT_TRUE(r.response.done());
    ASSERT_EQ(r.response.step(), static_cast<uint64_t>(step));
    ASSERT_TRUE(engine.MatchesReference(rows)) << "step " << step;
    ASSERT_EQ(engine.buffers().selection_done(), static_cast<uint64_t>(step));
  }
}

class IntegrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing::TestSeed();
    engine_ = std::make_unique<TestEngine>(testing::SmallServiceModel(), 2, 2048, 2, seed_);
    engine_->Fill(0, 0, 2048);
    engine_->Fill(1, 1, 2048);
  }
  uint64_t seed_ = 0;
  std::unique_ptr<TestEngine> engine_;
};

TEST_F(IntegrationTest, UnaryOverUnixSocketMatchesTheCoreReference) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("uds"));
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(Options(epsd->target()), engine_->Attach("engine-uds"));
  ASSERT_TRUE(client.Attach().ok());
  RunSteps(client, *engine_, 20, 1500);
  EXPECT_EQ(client.counters().fallbacks(), 0u);
}

TEST_F(IntegrationTest, UnaryOverLoopbackTcpMatchesTheCoreReference) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  auto epsd = EpsdProcess::Start("127.0.0.1:0");
  ASSERT_NE(epsd, nullptr);
  EXPECT_EQ(epsd->target().rfind("127.0.0.1:", 0), 0u) << epsd->target();
  client::EpsClient client(Options(epsd->target()), engine_->Attach("engine-tcp"));
  ASSERT_TRUE(client.Attach().ok());
  RunSteps(client, *engine_, 10, 1800);
}

TEST_F(IntegrationTest, StreamFormAnswersEveryStepInOrder) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("stream"));
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(Options(epsd->target(), /*stream=*/true), engine_->Attach("engine-s"));
  ASSERT_TRUE(client.Attach().ok());
  RunSteps(client, *engine_, 30, 1200);
  EXPECT_EQ(client.counters().selected, 30u);
}

TEST_F(IntegrationTest, ConcurrentSessionsAreServedIndependently) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("conc"));
  ASSERT_NE(epsd, nullptr);
  constexpr int kEngines = 4;
  std::vector<std::unique_ptr<TestEngine>> engines;
  for (int e = 0; e < kEngines; ++e) {
    engines.push_back(
        std::make_unique<TestEngine>(testing::SmallServiceModel(), 2, 2048, 2, seed_ + e));
    engines.back()->Fill(0, 0, 2048);
    engines.back()->Fill(1, 1, 2048);
  }
  std::vector<std::thread> threads;
  std::vector<int> failures(kEngines, 0);
  for (int e = 0; e < kEngines; ++e) {
    threads.emplace_back([&, e] {
      client::EpsClient client(Options(epsd->target(), e % 2 == 1),
                               engines[e]->Attach("engine-" + std::to_string(e)));
      if (!client.Attach().ok()) ++failures[e];
      for (int step = 1; step <= 25; ++step) {
        std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 1000 + step + e),
                                          TestEngine::Row(1, 900 + step)};
        const client::StepResult r = client.SelectPages(step, rows);
        if (r.fallback || !engines[e]->MatchesReference(rows)) ++failures[e];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int e = 0; e < kEngines; ++e) EXPECT_EQ(failures[e], 0) << "engine " << e;
}

// features.quest8 crosses the wire and questclt reads that part in epsd as in core/:
// records with both quest parts, and with quest8 alone.
TEST_F(IntegrationTest, Quest8RecordsMatchTheReference) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("quest8"));
  ASSERT_NE(epsd, nullptr);
  for (const bool with_quest : {true, false}) {
    ModelLayout model = testing::SmallServiceModel();
    model.features.quest = with_quest;
    model.features.quest8 = true;
    TestEngine engine(model, 2, 2048, 2, seed_ + (with_quest ? 1 : 2));
    engine.Fill(0, 0, 2048);
    engine.Fill(1, 1, 2048);
    client::EpsClient client(Options(epsd->target()),
                             engine.Attach(with_quest ? "engine-q8-both" : "engine-q8-only"));
    ASSERT_TRUE(client.Attach().ok());
    RunSteps(client, engine, 5, 1900);
    EXPECT_EQ(client.counters().fallbacks(), 0u);
  }
}

TEST_F(IntegrationTest, PerKvHeadOutputsMatchTheReference) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  TestEngine engine(testing::SmallServiceModel(), 2, 2048, 2, seed_, Granularity::kPerKvHead);
  engine.Fill(0, 0, 2048);
  engine.Fill(1, 1, 2048);
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("perhead"));
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(Options(epsd->target()), engine.Attach("engine-ph"));
  ASSERT_TRUE(client.Attach().ok());
  RunSteps(client, engine, 5, 1900);
}

TEST_F(IntegrationTest, MassBudgetPerCallMatchesTheReferenceAndRejectsABadTarget) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("mass"));
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(Options(epsd->target()), engine_->Attach("engine-mass"));
  ASSERT_TRUE(client.Attach().ok());
  v1::SelectOptions options;
  options.set_budget(v1::BUDGET_MASS);
  options.set_mass_target(0.8f);
  options.set_mass_temperature(2.0f);
  options.set_min_pages(1);
  options.set_max_pages(6);
  SelectPolicy policy;
  policy.budget = Budget::kMass;
  policy.mass_target = 0.8f;
  policy.mass_temperature = 2.0f;
  policy.min_pages = 1;
  policy.max_pages = 6;
  for (int step = 1; step <= 5; ++step) {
    std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 1700 + step),
                                      TestEngine::Row(1, 1000 + step)};
    const client::StepResult r = client.SelectPages(step, rows, &options);
    ASSERT_FALSE(r.fallback) << "step " << step << ": " << r.status;
    ASSERT_TRUE(engine_->MatchesReference(rows, policy)) << "step " << step;
  }
  options.set_mass_target(1.5f);
  const std::vector<v1::BatchRow> one = {TestEngine::Row(0, 1800)};
  const client::StepResult bad = client.SelectPages(6, one, &options);
  EXPECT_TRUE(bad.fallback);
  EXPECT_NE(bad.status.message().find("mass_target=1.5"), std::string::npos) << bad.status;
}

// Per-layer mass settings through the C++ client's per-call options: each step selects as
// core/ with the same settings; one setting too few fails the call naming the count.
TEST_F(IntegrationTest, PerLayerMassSettingsPerCallMatchTheReferenceAndAWrongCountIsRefused) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("masslayers"));
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(Options(epsd->target()), engine_->Attach("engine-mass-layers"));
  ASSERT_TRUE(client.Attach().ok());
  SelectPolicy policy;
  policy.budget = Budget::kMass;
  policy.mass_layers = {{.target = 0.6f, .temperature = 0.5f, .min_pages = 0, .max_pages = 2},
                        {.target = 0.95f, .temperature = 2.0f, .min_pages = 1, .max_pages = 0}};
  v1::SelectOptions options;
  options.set_budget(v1::BUDGET_MASS);
  for (const MassSetting& m : policy.mass_layers) {
    v1::MassSetting* out = options.add_mass_layers();
    out->set_target(m.target);
    out->set_temperature(m.temperature);
    out->set_min_pages(static_cast<uint32_t>(m.min_pages));
    out->set_max_pages(static_cast<uint32_t>(m.max_pages));
  }
  for (int step = 1; step <= 3; ++step) {
    std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 1700 + step),
                                      TestEngine::Row(1, 1000 + step)};
    const client::StepResult r = client.SelectPages(step, rows, &options);
    ASSERT_FALSE(r.fallback) << "step " << step << ": " << r.status;
    ASSERT_TRUE(engine_->MatchesReference(rows, policy)) << "step " << step;
  }
  options.mutable_mass_layers()->RemoveLast();
  const std::vector<v1::BatchRow> one = {TestEngine::Row(0, 1800)};
  const client::StepResult bad = client.SelectPages(4, one, &options);
  EXPECT_TRUE(bad.fallback);
  EXPECT_EQ(bad.status.code(), absl::StatusCode::kInvalidArgument) << bad.status;
  EXPECT_NE(bad.status.message().find("mass_layers has 1 settings, want one per layer (2)"),
            std::string::npos)
      << bad.status;
}

// The coarse level over the wire: layout.coarse_blocks, the coarse pool and table in
// the engine's shm object, options.coarse_candidates; every list equals core/'s.
TEST_F(IntegrationTest, CoarseLevelSessionMatchesTheReferenceAndBadAttachesAreRefused) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  ModelLayout model = testing::SmallServiceModel();
  model.coarse_blocks = 8;
  TestEngine engine(model, 2, 2048, 2, seed_ + 7);
  engine.Fill(0, 0, 2048);
  engine.Fill(1, 1, 2048);
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("coarse"));
  ASSERT_NE(epsd, nullptr);
  SelectPolicy policy;
  policy.top_pages = 4;
  policy.coarse_candidates = 1.5f;
  v1::AttachRequest attach = engine.Attach("engine-coarse");
  attach.mutable_options()->set_top_pages(4);
  attach.mutable_options()->set_coarse_candidates(1.5f);
  client::EpsClient client(Options(epsd->target()), attach);
  ASSERT_TRUE(client.Attach().ok());
  for (int step = 1; step <= 5; ++step) {
    std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 1900 + step),
                                      TestEngine::Row(1, 1000 + step)};
    const client::StepResult r = client.SelectPages(step, rows);
    ASSERT_FALSE(r.fallback) << "step " << step << ": " << r.status;
    ASSERT_TRUE(engine.MatchesReference(rows, policy)) << "step " << step;
  }

  v1::AttachRequest missing = attach;
  missing.set_engine_id("engine-coarse-missing");
  missing.mutable_buffers()->clear_coarse_table();
  client::EpsClient refused(Options(epsd->target()), missing);
  absl::Status s = refused.Attach();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "coarse_table is required: layout.coarse_blocks=8 has a coarse level");

  v1::AttachRequest flat = attach;
  flat.set_engine_id("engine-coarse-flat");
  flat.mutable_layout()->set_coarse_blocks(0);
  client::EpsClient refused_flat(Options(epsd->target()), flat);
  s = refused_flat.Attach();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "coarse_pool is set, but layout.coarse_blocks=0 (no coarse level)");

  v1::AttachRequest odd = attach;
  odd.set_engine_id("engine-coarse-odd");
  odd.mutable_layout()->set_coarse_blocks(7);
  client::EpsClient refused_odd(Options(epsd->target()), odd);
  s = refused_odd.Attach();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("layout.coarse_blocks=7"), std::string::npos) << s;

  // The healthy session is untouched by the refusals.
  const std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 2000)};
  const client::StepResult r = client.SelectPages(6, rows);
  ASSERT_FALSE(r.fallback) << r.status;
  EXPECT_TRUE(engine.MatchesReference(rows, policy));
}

// Selection feedback over the wire: the feedback buffer in the engine's shm object,
// written before each step as an attention would; every list equals core/'s with the
// same feedback, and epsd leaves the step's rows NaN (consumed) after each step.
TEST_F(IntegrationTest, FeedbackSessionMatchesTheReferenceAndConsumesTheStepsRows) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  TestEngine engine(testing::SmallServiceModel(), 2, 2048, 2, seed_ + 11, Granularity::kUnion,
                    /*with_feedback=*/true);
  engine.Fill(0, 0, 2048);
  engine.Fill(1, 1, 2048);
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("feedback"));
  ASSERT_NE(epsd, nullptr);
  SelectPolicy policy;
  policy.top_pages = 4;
  v1::AttachRequest attach = engine.Attach("engine-feedback");
  ASSERT_TRUE(attach.buffers().has_feedback());
  attach.mutable_options()->set_top_pages(4);
  client::EpsClient client(Options(epsd->target()), attach);
  ASSERT_TRUE(client.Attach().ok());
  for (int step = 1; step <= 4; ++step) {
    std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 1900 + step),
                                      TestEngine::Row(1, 1000 + step)};
    engine.FillFeedback(0, 1900 + step);
    engine.FillFeedback(1, 1000 + step);
    const std::vector<float> before = engine.Feedback();
    const client::StepResult r = client.SelectPages(step, rows);
    ASSERT_FALSE(r.fallback) << "step " << step << ": " << r.status;
    ASSERT_TRUE(engine.MatchesReference(rows, policy, before)) << "step " << step;
    for (const float v : engine.Feedback()) ASSERT_TRUE(std::isnan(v)) << "step " << step;
  }
}

TEST_F(IntegrationTest, InlineBuffersCarryDataAndVisitListsInTheMessages) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("inline"));
  ASSERT_NE(epsd, nullptr);
  // Same data as the shm engine, but every buffer inline: its bytes go in Attach.
  v1::AttachRequest attach = engine_->Attach("engine-inline");
  v1::SharedBuffers* b = attach.mutable_buffers();
  client::EngineBuffers& buf = engine_->buffers();
  auto make_inline = [&](v1::MemoryDescriptor* d, const void* data, size_t bytes) {
    d->mutable_inline_bytes()->set_data(std::string(static_cast<const char*>(data), bytes));
    d->set_offset(0);
  };
  const auto pool = buf.summary_pool();
  make_inline(b->mutable_summary_pool(), pool.data(), pool.size_bytes());
  make_inline(b->mutable_group_table(), buf.GroupRow(0).data(), 2 * buf.GroupRow(0).size_bytes());
  make_inline(b->mutable_block_table(), buf.BlockRow(0).data(), 2 * buf.BlockRow(0).size_bytes());
  make_inline(b->mutable_queries(), buf.Query(0, 0, 0).data(),
              2 * 2 * 4 * 32 * sizeof(float));  // [layers, batch, q_heads, d]
  make_inline(b->mutable_visit_blocks(), "", 0);
  make_inline(b->mutable_visit_count(), "", 0);
  b->clear_flags();
  auto channel = grpc::CreateChannel(epsd->target(), grpc::InsecureChannelCredentials());
  auto stub = v1::PageSelector::NewStub(channel);
  grpc::ClientContext attach_context;
  v1::AttachResponse attached;
  ASSERT_TRUE(stub->Attach(&attach_context, attach, &attached).ok());
  // The shm engine's run is the reference for the inline one.
  client::EpsClient shm_client(Options(epsd->target()), engine_->Attach("engine-shm"));
  ASSERT_TRUE(shm_client.Attach().ok());
  std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 2000), TestEngine::Row(1, 1000)};
  ASSERT_FALSE(shm_client.SelectPages(1, rows).fallback);
  v1::SelectPagesRequest request;
  request.set_session_id(attached.session_id());
  request.set_step(1);
  request.mutable_rows()->Add(rows.begin(), rows.end());
  grpc::ClientContext context;
  v1::SelectPagesResponse response;
  ASSERT_TRUE(stub->SelectPages(&context, request, &response).ok());
  ASSERT_EQ(response.visit_lists_size(), 2 * 2);
  for (const v1::VisitList& list : response.visit_lists()) {
    const auto want = buf.VisitBlocks(list.layer(), list.batch_index());
    EXPECT_EQ(std::vector<int32_t>(list.blocks().begin(), list.blocks().end()),
              std::vector<int32_t>(want.begin(), want.end()));
    EXPECT_GT(list.visited_tokens(), 0);
  }
}

TEST_F(IntegrationTest, InlineWritesUpdateInputsBeforeTheStep) {
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("writes"));
  ASSERT_NE(epsd, nullptr);
  v1::AttachRequest attach = engine_->Attach("engine-writes");
  attach.mutable_buffers()->mutable_queries()->mutable_inline_bytes();  // zeros
  attach.mutable_buffers()->mutable_queries()->set_offset(0);
  auto stub = v1::PageSelector::NewStub(
      grpc::CreateChannel(epsd->target(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext c1;
  v1::AttachResponse attached;
  ASSERT_TRUE(stub->Attach(&c1, attach, &attached).ok());
  // Send the shm queries as one write: the result must equal the all-shm reference.
  v1::SelectPagesRequest request;
  request.set_session_id(attached.session_id());
  request.set_step(1);
  *request.add_rows() = TestEngine::Row(0, 2000);
  v1::BufferWrite* w = request.add_writes();
  w->set_target(v1::BufferWrite::TARGET_QUERIES);
  w->set_data(std::string(reinterpret_cast<const char*>(engine_->buffers().Query(0, 0, 0).data()),
                          2 * 2 * 4 * 32 * sizeof(float)));
  grpc::ClientContext c2;
  v1::SelectPagesResponse response;
  ASSERT_TRUE(stub->SelectPages(&c2, request, &response).ok());
  EXPECT_TRUE(engine_->MatchesReference({TestEngine::Row(0, 2000)}));
}

TEST_F(IntegrationTest, PingHeartbeatAndStatsAnswer) {
  // A budget that leaves groups of these rows out (the default top_pages covers 2,048 tokens).
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("stats"), {"--eps-top-pages=4"});
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(Options(epsd->target()), engine_->Attach("engine-stats"));
  ASSERT_TRUE(client.Attach().ok());
  ASSERT_TRUE(client.Ping(std::chrono::seconds(1)).ok());
  SelectPolicy policy;
  policy.top_pages = 4;
  for (int step = 1; step <= 3; ++step) {
    const std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 1000 + step),
                                            TestEngine::Row(1, 500 + step)};
    const client::StepResult r = client.SelectPages(step, rows);
    ASSERT_FALSE(r.fallback) << "step " << step << ": " << r.status;
    ASSERT_TRUE(engine_->MatchesReference(rows, policy)) << "step " << step;
  }
  ASSERT_TRUE(client.Heartbeat().ok());
  grpc::ClientContext context;
  v1::GetStatsRequest request;
  v1::GetStatsResponse stats;
  ASSERT_TRUE(client.stub().GetStats(&context, request, &stats).ok());
  EXPECT_EQ(stats.sessions_active(), 1u);
  EXPECT_EQ(stats.steps_total(), 3u);
  ASSERT_EQ(stats.sessions_size(), 1);
  EXPECT_EQ(stats.sessions(0).engine_id(), "engine-stats");
  EXPECT_GT(stats.sessions(0).groups_total(), stats.sessions(0).groups_visited());
}

TEST_F(IntegrationTest, HealthServiceReportsServingForTheServerAndPageSelector) {
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("health"));
  ASSERT_NE(epsd, nullptr);
  auto health = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(epsd->target(), grpc::InsecureChannelCredentials()));
  for (const std::string service : {"", "eps.v1.PageSelector"}) {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(health->Check(&context, request, &response).ok()) << "service '" << service << "'";
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
}

TEST_F(IntegrationTest, ReattachingWithTheSameEngineIdReplacesTheSession) {
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("replace"));
  ASSERT_NE(epsd, nullptr);
  client::EpsClient first(Options(epsd->target()), engine_->Attach("same-engine"));
  ASSERT_TRUE(first.Attach().ok());
  client::EpsClient second(Options(epsd->target()), engine_->Attach("same-engine"));
  ASSERT_TRUE(second.Attach().ok());
  grpc::ClientContext context;
  v1::GetStatsResponse stats;
  ASSERT_TRUE(second.stub().GetStats(&context, v1::GetStatsRequest(), &stats).ok());
  EXPECT_EQ(stats.sessions_active(), 1u);
  EXPECT_NE(first.session_id(), second.session_id());
}

}  // namespace
}  // namespace eps
