// Malformed requests against a running epsd: each gets its precise status and
// message, and a healthy session keeps being served correctly after every one.
#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "client/cpp/eps_client.h"
#include "gtest/gtest.h"
#include "tests/service/epsd_process.h"
#include "tests/service/test_engine.h"

namespace eps {
namespace {

using testing::EpsdProcess;
using testing::TestEngine;
using Code = grpc::StatusCode;

// What a case may mutate: the Attach of a fresh session, or a SelectPages of
// the "victim" session whose shared memory it may also corrupt (and restore).
struct Case {
  std::string name;
  std::function<void(v1::AttachRequest&)> attach;                    // Attach cases
  std::function<void(v1::SelectPagesRequest&, TestEngine&)> select;  // SelectPages cases
  std::function<void(TestEngine&)> restore;
  Code code;
  std::string fragment;  // part of the expected message
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class MalformedTest : public ::testing::TestWithParam<Case> {
 protected:
  static void SetUpTestSuite() {
    epsd_ = EpsdProcess::Start(testing::UniqueSocket("malformed"),
                               {"--max-batch=8", "--max-message-bytes=1048576"})
                .release();
    ASSERT_NE(epsd_, nullptr);
    healthy_ = new TestEngine(testing::SmallServiceModel(), 2, 2048, 2, 11);
    healthy_->Fill(0, 0, 2048);
    healthy_->Fill(1, 1, 2048);
    client::ClientOptions o;
    o.target = epsd_->target();
    o.deadline = std::chrono::seconds(2);
    o.attach_deadline = std::chrono::seconds(5);  // generous: CI machines are slow and shared
    healthy_client_ = new client::EpsClient(o, healthy_->Attach("healthy"));
    ASSERT_TRUE(healthy_client_->Attach().ok());
    victim_ = new TestEngine(testing::SmallServiceModel(), 2, 2048, 2, 12);
    victim_->Fill(0, 0, 2048);
    victim_->Fill(1, 1, 2048);
    stub_ = v1::PageSelector::NewStub(
                grpc::CreateChannel(epsd_->target(), grpc::InsecureChannelCredentials()))
                .release();
    grpc::ClientContext context;
    v1::AttachResponse response;
    ASSERT_TRUE(stub_->Attach(&context, victim_->Attach("victim"), &response).ok());
    victim_session_ = response.session_id();
    // One good step, so that a replayed step is a replay even when run alone.
    v1::SelectPagesRequest first;
    first.set_session_id(victim_session_);
    first.set_step(++victim_step_);
    *first.add_rows() = TestEngine::Row(0, 1000);
    grpc::ClientContext step_context;
    v1::SelectPagesResponse step_response;
    ASSERT_TRUE(stub_->SelectPages(&step_context, first, &step_response).ok());
  }
  static void TearDownTestSuite() {
    delete stub_;
    delete healthy_client_;
    delete healthy_;
    delete victim_;
    delete epsd_;
  }

  static void ExpectHealthyStep() {
    static uint64_t step = 0;
    ++step;
    const std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 1500 + step),
                                            TestEngine::Row(1, 800 + step)};
    const client::StepResult r = healthy_client_->SelectPages(step, rows);
    ASSERT_FALSE(r.fallback) << r.status;
    EXPECT_TRUE(healthy_->MatchesReference(rows));
  }

  static EpsdProcess* epsd_;
  static TestEngine* healthy_;
  static client::EpsClient* healthy_client_;
  static TestEngine* victim_;
  static std::string victim_session_;
  static v1::PageSelector::Stub* stub_;
  static uint64_t victim_step_;
};

EpsdProcess* MalformedTest::epsd_ = nullptr;
TestEngine* MalformedTest::healthy_ = nullptr;
client::EpsClient* MalformedTest::healthy_client_ = nullptr;
TestEngine* MalformedTest::victim_ = nullptr;
std::string MalformedTest::victim_session_;
v1::PageSelector::Stub* MalformedTest::stub_ = nullptr;
uint64_t MalformedTest::victim_step_ = 100;

TEST_P(MalformedTest, GetsItsStatusAndTheServiceKeepsServing) {
  const Case& c = GetParam();
  ExpectHealthyStep();
  grpc::Status status;
  if (c.attach) {
    v1::AttachRequest request = victim_->Attach("malformed-" + c.name);
    c.attach(request);
    grpc::ClientContext context;
    v1::AttachResponse response;
    status = stub_->Attach(&context, request, &response);
  } else {
    v1::SelectPagesRequest request;
    request.set_session_id(victim_session_);
    request.set_step(++victim_step_);
    *request.add_rows() = TestEngine::Row(0, 1000);
    *request.add_rows() = TestEngine::Row(1, 500);
    c.select(request, *victim_);
    grpc::ClientContext context;
    v1::SelectPagesResponse response;
    status = stub_->SelectPages(&context, request, &response);
    if (c.restore) c.restore(*victim_);
  }
  EXPECT_EQ(status.error_code(), c.code) << status.error_message();
  EXPECT_NE(status.error_message().find(c.fragment), std::string::npos)
      << "message: " << status.error_message() << "\nwant: " << c.fragment;
  ExpectHealthyStep();
  // The victim still works after the bad call (except where the case ended it).
  v1::SelectPagesRequest good;
  good.set_session_id(victim_session_);
  good.set_step(++victim_step_);
  *good.add_rows() = TestEngine::Row(0, 1000);
  grpc::ClientContext context;
  v1::SelectPagesResponse response;
  EXPECT_TRUE(stub_->SelectPages(&context, good, &response).ok());
  EXPECT_TRUE(victim_->MatchesReference({TestEngine::Row(0, 1000)}));
}

v1::MemoryDescriptor* Pool(v1::AttachRequest& r) {
  return r.mutable_buffers()->mutable_summary_pool();
}

std::vector<Case> Cases() {
  std::vector<Case> c;
  auto attach = [&](std::string name, std::function<void(v1::AttachRequest&)> f, Code code,
                    std::string fragment) {
    c.push_back({std::move(name), std::move(f), nullptr, nullptr, code, std::move(fragment)});
  };
  auto select = [&](std::string name, std::function<void(v1::SelectPagesRequest&, TestEngine&)> f,
                    std::function<void(TestEngine&)> restore, Code code, std::string fragment) {
    c.push_back(
        {std::move(name), nullptr, std::move(f), std::move(restore), code, std::move(fragment)});
  };
  using A = v1::AttachRequest;
  // ---- Attach: layout ----
  attach(
      "EmptyEngineId", [](A& r) { r.clear_engine_id(); }, Code::INVALID_ARGUMENT, "engine_id");
  attach(
      "ZeroLayers", [](A& r) { r.mutable_layout()->set_num_layers(0); }, Code::INVALID_ARGUMENT,
      "layout.num_layers=0 not in [1, 4096]");
  attach(
      "QueryHeadsNotMultipleOfKvHeads", [](A& r) { r.mutable_layout()->set_num_q_heads(3); },
      Code::INVALID_ARGUMENT, "num_q_heads=3 is not a multiple of num_kv_heads=2");
  attach(
      "HeadDimNotMultipleOfFour", [](A& r) { r.mutable_layout()->set_head_dim(30); },
      Code::INVALID_ARGUMENT, "head_dim=30 is not a multiple of 4");
  attach(
      "SketchDimTooLarge", [](A& r) { r.mutable_layout()->set_sketch_dim(65); },
      Code::INVALID_ARGUMENT, "sketch_dim=65");
  attach(
      "HugeLayerCount", [](A& r) { r.mutable_layout()->set_num_layers(4000000000u); },
      Code::INVALID_ARGUMENT, "too large");
  attach(
      "QueryDtypeNotFloat", [](A& r) { r.mutable_layout()->set_query_dtype(v1::DTYPE_INT32); },
      Code::INVALID_ARGUMENT, "query_dtype=DTYPE_INT32");
  // ---- Attach: descriptors ----
  attach(
      "PoolWrongDtype", [](A& r) { Pool(r)->set_dtype(v1::DTYPE_FLOAT16); }, Code::INVALID_ARGUMENT,
      "summary_pool.dtype=DTYPE_FLOAT16, want DTYPE_FLOAT32");
  attach(
      "PoolWrongRank", [](A& r) { Pool(r)->mutable_shape()->RemoveLast(); }, Code::INVALID_ARGUMENT,
      "summary_pool has rank 3, want 4");
  attach(
      "PoolLayersMismatch", [](A& r) { Pool(r)->set_shape(1, 3); }, Code::INVALID_ARGUMENT,
      "summary_pool.shape[1]=3 does not match num_layers=2");
  attach(
      "RecordWordsDoNotMatchFeatures",
      [](A& r) { r.mutable_layout()->mutable_features()->set_principal(true); },
      Code::INVALID_ARGUMENT, "does not match record_words=");
  attach(
      "NonContiguousStrides",
      [](A& r) {
        auto* d = r.mutable_buffers()->mutable_group_table();
        d->add_strides(d->shape(1) * 2);
        d->add_strides(1);
      },
      Code::INVALID_ARGUMENT, "contiguous row-major only");
  attach(
      "StridesOfWrongRank",
      [](A& r) { r.mutable_buffers()->mutable_group_table()->add_strides(1); },
      Code::INVALID_ARGUMENT, "has 1 strides for rank 2");
  attach(
      "ZeroDimension", [](A& r) { r.mutable_buffers()->mutable_block_table()->set_shape(1, 0); },
      Code::INVALID_ARGUMENT, "block_table.shape[1]=0 must be >= 1");
  attach(
      "ShapeOverflowsInt64", [](A& r) { Pool(r)->set_shape(0, int64_t{1} << 62); },
      Code::INVALID_ARGUMENT, "overflows");
  attach(
      "MisalignedOffset", [](A& r) { Pool(r)->set_offset(Pool(r)->offset() + 2); },
      Code::INVALID_ARGUMENT, "is not aligned");
  attach(
      "ExtentBeyondTheAllocation", [](A& r) { Pool(r)->set_shape(0, Pool(r)->shape(0) * 50); },
      Code::INVALID_ARGUMENT, "exceeds the");
  attach(
      "OffsetOverflows", [](A& r) { Pool(r)->set_offset(~uint64_t{0} - 3); },
      Code::INVALID_ARGUMENT, "offset + size overflows");
  attach(
      "UnknownShmName", [](A& r) { Pool(r)->mutable_host_shm()->set_name("/eps-no-such-object"); },
      Code::NOT_FOUND, "shm_open(/eps-no-such-object)");
  attach(
      "ShmNameWithoutSlash", [](A& r) { Pool(r)->mutable_host_shm()->set_name("x/y"); },
      Code::INVALID_ARGUMENT, "must be '/'");
  attach(
      "WrongDeclaredShmSize",
      [](A& r) {
        auto* b = r.mutable_buffers();
        for (auto* d : {b->mutable_summary_pool(), b->mutable_group_table(),
                        b->mutable_block_table(), b->mutable_queries(), b->mutable_visit_blocks(),
                        b->mutable_visit_count(), b->mutable_flags()}) {
          d->mutable_host_shm()->set_size(d->host_shm().size() + 4096);
        }
      },
      Code::INVALID_ARGUMENT, "declared size");
  attach(
      "MemoryNotSet", [](A& r) { r.mutable_buffers()->mutable_queries()->clear_host_shm(); },
      Code::INVALID_ARGUMENT, "queries.memory is not set");
  attach(
      "CudaMemoryOnTheCpuBackend",
      [](A& r) { Pool(r)->mutable_cuda_ipc()->set_handle(std::string(64, 'x')); },
      Code::FAILED_PRECONDITION, "summary_pool is CUDA device memory");
  attach(
      "OutputOverlapsAnInput",
      [](A& r) { r.mutable_buffers()->mutable_visit_count()->set_offset(Pool(r)->offset()); },
      Code::INVALID_ARGUMENT, "visit_count overlaps summary_pool");
  attach(
      "BlockTableRowsDiffer",
      [](A& r) { r.mutable_buffers()->mutable_block_table()->set_shape(0, 1); },
      Code::INVALID_ARGUMENT, "block_table.shape[0]=1 does not match group_table.shape[0]=2");
  attach(
      "QueriesBatchDiffers", [](A& r) { r.set_max_batch(1); }, Code::INVALID_ARGUMENT,
      "queries.shape[1]=2 does not match max_batch=1");
  attach(
      "ZeroMaxBatch", [](A& r) { r.set_max_batch(0); }, Code::INVALID_ARGUMENT, "max_batch=0");
  attach(
      "MaxBatchAboveTheServerLimit", [](A& r) { r.set_max_batch(9); }, Code::RESOURCE_EXHAUSTED,
      "exceeds the server's --max-batch=8");
  attach(
      "CudaBackendRequested", [](A& r) { r.set_backend(v1::BACKEND_CUDA); },
      Code::FAILED_PRECONDITION, "BACKEND_CUDA is not available");
  attach(
      "AlphaBelowOne", [](A& r) { r.mutable_options()->set_alpha(0.5f); }, Code::INVALID_ARGUMENT,
      "alpha=0.5 must be finite and >= 1");
  attach(
      "RetrievalHeadsWithoutMarks",
      [](A& r) { r.mutable_options()->set_heads(v1::HEAD_MODE_RETRIEVAL); }, Code::INVALID_ARGUMENT,
      "needs options.retrieval_heads");
  attach(
      "GranularityDoesNotMatchOutputs",
      [](A& r) { r.mutable_options()->set_granularity(v1::GRANULARITY_PER_KV_HEAD); },
      Code::INVALID_ARGUMENT, "does not match the rank-3 visit_blocks buffer");
  attach(
      "InlineBufferTooLarge",
      [](A& r) {
        Pool(r)->mutable_inline_bytes();
        Pool(r)->set_offset(0);
        Pool(r)->set_shape(0, int64_t{1} << 28);
      },
      Code::RESOURCE_EXHAUSTED, "summary_pool inline buffer needs");
  // ---- SelectPages ----
  using S = v1::SelectPagesRequest;
  select(
      "UnknownSession", [](S& r, TestEngine&) { r.set_session_id("s-nope"); }, nullptr,
      Code::NOT_FOUND, "session 's-nope' not found");
  select(
      "ReplayedStep", [](S& r, TestEngine&) { r.set_step(1); }, nullptr, Code::FAILED_PRECONDITION,
      "is not after the session's last step");
  select(
      "BatchAboveMaxBatch", [](S& r, TestEngine&) { *r.add_rows() = TestEngine::Row(0, 10); },
      nullptr, Code::INVALID_ARGUMENT, "batch of 3 rows exceeds the session's max_batch=2");
  select(
      "TableRowOutOfRange", [](S& r, TestEngine&) { r.mutable_rows(1)->set_table_row(2); }, nullptr,
      Code::INVALID_ARGUMENT, "rows[1].table_row=2 not in [0, 2)");
  select(
      "NegativeTableRow", [](S& r, TestEngine&) { r.mutable_rows(0)->set_table_row(-1); }, nullptr,
      Code::INVALID_ARGUMENT, "rows[0].table_row=-1");
  select(
      "ZeroContext", [](S& r, TestEngine&) { r.mutable_rows(0)->set_context_tokens(0); }, nullptr,
      Code::INVALID_ARGUMENT, "rows[0].context_tokens=0");
  select(
      "ContextLongerThanCapacity",
      [](S& r, TestEngine&) { r.mutable_rows(1)->set_context_tokens(2049); }, nullptr,
      Code::INVALID_ARGUMENT, "rows[1].context_tokens=2049 not in [1, 2048]");
  select(
      "SlotOutOfRange", [](S&, TestEngine& e) { e.buffers().GroupRow(0)[3] = 1 << 20; },
      [](TestEngine& e) { e.buffers().GroupRow(0)[3] = 3; }, Code::INVALID_ARGUMENT,
      "group_table[0][3]=1048576 not in [0, ");
  select(
      "BlockIdBeyondTheKvPool",
      [](S&, TestEngine& e) {
        e.buffers().BlockRow(1)[5] += static_cast<int32_t>(e.num_kv_blocks());
      },
      [](TestEngine& e) { e.buffers().BlockRow(1)[5] -= static_cast<int32_t>(e.num_kv_blocks()); },
      Code::INVALID_ARGUMENT, "block_table[1][5]=");
  select(
      "NaNInAQuery", [](S&, TestEngine& e) { e.buffers().Query(1, 0, 2)[4] = std::nanf(""); },
      [](TestEngine& e) { e.buffers().Query(1, 0, 2)[4] = 0.5f; }, Code::INVALID_ARGUMENT,
      "query[layer 1][row 0][head 2][4] is nan");
  select(
      "InfInASummary",
      [](S&, TestEngine& e) {
        // fro2: read by every method (quest without its part falls back to fro).
        e.buffers().Record(e.buffers().GroupRow(0)[2], 1, 0)[SummaryLayout::For(e.model()).fro2] =
            std::numeric_limits<float>::infinity();
      },
      [](TestEngine& e) {
        e.buffers().Record(e.buffers().GroupRow(0)[2], 1, 0)[SummaryLayout::For(e.model()).fro2] =
            1.0f;
      },
      Code::INVALID_ARGUMENT, "the summary holds NaN or Inf");
  select(
      "WriteIntoSharedMemory",
      [](S& r, TestEngine&) {
        auto* w = r.add_writes();
        w->set_target(v1::BufferWrite::TARGET_QUERIES);
        w->set_data("abcd");
      },
      nullptr, Code::FAILED_PRECONDITION, "lives in shared memory");
  select(
      "WriteWithoutTarget", [](S& r, TestEngine&) { r.add_writes()->set_data("abcd"); }, nullptr,
      Code::INVALID_ARGUMENT, "writes[0].target=0 is not a writable input");
  select(
      "AsyncReplyOnTheCpuBackend",
      [](S& r, TestEngine&) { r.set_reply_mode(v1::REPLY_MODE_ASYNC); }, nullptr,
      Code::UNIMPLEMENTED, "REPLY_MODE_ASYNC");
  select(
      "PerCallAlphaBelowOne", [](S& r, TestEngine&) { r.mutable_options()->set_alpha(0.0f); },
      nullptr, Code::INVALID_ARGUMENT, "alpha=0 must be finite and >= 1");
  select(
      "PerCallGranularityMismatch",
      [](S& r, TestEngine&) { r.mutable_options()->set_granularity(v1::GRANULARITY_PER_KV_HEAD); },
      nullptr, Code::INVALID_ARGUMENT, "does not match the session's output buffers");
  select(
      "UnknownMethod",
      [](S& r, TestEngine&) { r.mutable_options()->set_method(static_cast<v1::Method>(42)); },
      nullptr, Code::INVALID_ARGUMENT, "options.method=42 is unknown");
  select(
      "MessageAboveTheSizeLimit",
      [](S& r, TestEngine&) { r.add_writes()->set_data(std::string(2 << 20, 'x')); }, nullptr,
      Code::RESOURCE_EXHAUSTED, "");
  return c;
}

INSTANTIATE_TEST_SUITE_P(Requests, MalformedTest, ::testing::ValuesIn(Cases()),
                         [](const auto& p) { return p.param.name; });

}  // namespace
}  // namespace eps
