#include "load/load_config.h"

#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "load/buffer_set.h"

namespace eps::load {
namespace {

using std::chrono::microseconds;

TEST(ParseFlags, DurationsTakeAbseilUnitsAndRefuseBareNumbers) {
  EXPECT_EQ(ParseFlags({"--duration=5s"})->duration, microseconds(5'000'000));
  EXPECT_EQ(ParseFlags({"--duration=250ms"})->duration, microseconds(250'000));
  EXPECT_EQ(ParseFlags({"--slo=100us"})->slo, microseconds(100));
  EXPECT_EQ(ParseFlags({"--duration=10m"})->duration, microseconds(600'000'000));
  EXPECT_EQ(ParseFlags({"--deadline=1.5s"})->deadline, microseconds(1'500'000));
  for (const char* bad : {"", "s", "-1s", "5x", "abc", "1.5", "0s"}) {
    const auto c = ParseFlags({std::string("--duration=") + bad});
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_NE(c.status().message().find("--duration="), std::string::npos) << c.status();
  }
}

TEST(ParseFlags, CoarseFlagsSetTheLayoutsLevelAndTheAttachOption) {
  const LoadConfig none = *ParseFlags({});
  EXPECT_EQ(none.model.coarse_blocks, 0);
  EXPECT_EQ(none.coarse_candidates, 0.0f);
  const LoadConfig c =
      *ParseFlags({"--eps-group-blocks=2", "--coarse-blocks=16", "--coarse-candidates=3"});
  EXPECT_EQ(c.model.coarse_blocks, 16);
  EXPECT_EQ(c.coarse_candidates, 3.0f);
  // Not a multiple of g above it: named by the two flags of the rule, with core's reason.
  const auto odd = ParseFlags({"--eps-group-blocks=2", "--coarse-blocks=5"});
  ASSERT_FALSE(odd.ok());
  EXPECT_EQ(odd.status().message(),
            "--coarse-blocks=5, --eps-group-blocks=2: coarse_blocks=5 must be 0 (no coarse "
            "level) or a multiple of group_blocks=2 above it, at most 4096");
  EXPECT_FALSE(ParseFlags({"--coarse-blocks=-4"}).ok());
  EXPECT_FALSE(ParseFlags({"--coarse-blocks=16", "--coarse-candidates=0.5"}).ok());
  const auto alone = ParseFlags({"--coarse-candidates=2"});
  ASSERT_FALSE(alone.ok());
  EXPECT_NE(alone.status().message().find("--coarse-candidates=2"), std::string::npos);
}

TEST(ParseFlags, FeedbackShareIsOffByDefaultAndRefusedOutsideZeroToOne) {
  EXPECT_EQ(ParseFlags({}).value().feedback_share, 0.0);
  EXPECT_EQ(ParseFlags({"--feedback-share=0.25"}).value().feedback_share, 0.25);
  EXPECT_EQ(ParseFlags({"--feedback-share=1"}).value().feedback_share, 1.0);
  for (const char* bad : {"1.5", "-0.1", "nan", "inf"}) {
    const auto c = ParseFlags({std::string("--feedback-share=") + bad});
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_NE(c.status().message().find(std::string("--feedback-share=") + bad), std::string::npos)
        << c.status();
    EXPECT_NE(c.status().message().find("(0, 1]"), std::string::npos) << c.status();
  }
}

TEST(ParseFlags, SizesAndShapeFlagsShareEpsdsNamesAndSuffixes) {
  const LoadConfig c =
      *ParseFlags({"--batch=1k", "--context=128k", "--eps-dim=16", "--group-blocks=4", "--layers=1",
                   "--kv-heads=1", "--q-heads=1"});  // a workload that fits
  EXPECT_EQ(c.batch, 1024);
  EXPECT_EQ(c.context.lo, 128 * 1024);
  EXPECT_EQ(c.model.sketch_dim, 16);
  EXPECT_EQ(c.model.group_blocks, 4);
  EXPECT_EQ(ParseFlags({"--sketch-dim=4"})->model.sketch_dim, 4);
  EXPECT_FALSE(c.model.features.quest8);
  EXPECT_TRUE(ParseFlags({"--quest8"})->model.features.quest8);
  EXPECT_TRUE(ParseFlags({"--quest8"})->model.features.quest);
  const LoadConfig only8 = *ParseFlags({"--quest8-only"});
  EXPECT_TRUE(only8.model.features.quest8);
  EXPECT_FALSE(only8.model.features.quest);
  EXPECT_FALSE(only8.model.features.key_sum);
  EXPECT_FALSE(ParseFlags({"--batch=abc"}).ok());
  EXPECT_TRUE(ParseFlags({"--version"})->version);
}

TEST(ParseContext, ReadsFixedKiloAndUniform) {
  EXPECT_EQ(ParseContext("32768")->lo, 32768);
  EXPECT_EQ(ParseContext("32k")->hi, 32768);
  const ContextDistribution d = *ParseContext("uniform:1k-4096");
  EXPECT_EQ(d.lo, 1024);
  EXPECT_EQ(d.hi, 4096);
  EXPECT_EQ(d.ToString(), "uniform:1024-4096");
}

TEST(ParseContext, RejectsInvertedOrMalformedRanges) {
  for (const char* bad : {"0", "uniform:9-3", "uniform:5", "normal:1-2", "-4"}) {
    EXPECT_FALSE(ParseContext(bad).ok()) << bad;
  }
}

TEST(ContextDistribution, DrawsStayInsideTheRange) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const ContextDistribution d = *ParseContext("uniform:100-130");
  bool saw_lo = false, saw_hi = false;
  for (int i = 0; i < 5000; ++i) {
    const int64_t t = d.Draw(rng);
    ASSERT_GE(t, 100);
    ASSERT_LE(t, 130);
    saw_lo |= t == 100;
    saw_hi |= t == 130;
  }
  EXPECT_TRUE(saw_lo && saw_hi);
}

TEST(ParseRate, ReadsClosedFixedAndPoisson) {
  EXPECT_TRUE(ParseRate("0")->closed_loop());
  const Arrivals fixed = *ParseRate("200");
  EXPECT_FALSE(fixed.closed_loop());
  EXPECT_FALSE(fixed.poisson);
  EXPECT_DOUBLE_EQ(fixed.rate, 200);
  const Arrivals p = *ParseRate("poisson:50.5");
  EXPECT_TRUE(p.poisson);
  EXPECT_DOUBLE_EQ(p.rate, 50.5);
  EXPECT_FALSE(ParseRate("poisson:0").ok());
  EXPECT_FALSE(ParseRate("-3").ok());
  EXPECT_FALSE(ParseRate("fast").ok());
}

TEST(ParseFlags, PresetsCarryTheirPublishedShapes) {
  const ModelLayout l8 = ParseFlags({"--preset=llama-3-8b"})->model;
  EXPECT_EQ(l8.num_layers, 32);
  EXPECT_EQ(l8.num_q_heads, 32);
  EXPECT_EQ(l8.num_kv_heads, 8);
  const ModelLayout tp = ParseFlags({"--preset=llama-3-70b-tp8"})->model;
  EXPECT_EQ(tp.num_layers, 80);
  EXPECT_EQ(tp.num_q_heads, 8);
  EXPECT_EQ(tp.num_kv_heads, 1);
  const ModelLayout q = ParseFlags({"--preset=qwen2.5-7b"})->model;
  EXPECT_EQ(q.num_q_heads, 28);
  EXPECT_EQ(q.num_kv_heads, 4);
  const ModelLayout s = ParseFlags({"--preset=smollm2-135m"})->model;
  EXPECT_EQ(s.head_dim, 64);
  EXPECT_EQ(s.num_kv_heads, 3);
}

TEST(ParseFlags, TheSeventyBPresetsSplitItsHeadsOverTheRanks) {
  for (const int tp : {2, 4, 8}) {
    const ModelLayout m = ParseFlags({"--preset=llama-3-70b-tp" + std::to_string(tp)})->model;
    EXPECT_EQ(m.num_layers, 80) << tp;
    EXPECT_EQ(m.num_q_heads * tp, 64) << tp;
    EXPECT_EQ(m.num_kv_heads * tp, 8) << tp;
    EXPECT_EQ(m.head_dim, 128) << tp;
  }
}

TEST(ParseFlags, RanksRunOneSessionEachInAClosedLoopWithoutPing) {
  const LoadConfig c = *ParseFlags({"--preset=llama-3-70b-tp4", "--ranks=4"});
  EXPECT_EQ(c.ranks, 4);
  EXPECT_EQ(c.sessions, 4);
  EXPECT_EQ(c.ping_every, 0);
  EXPECT_EQ(ParseFlags({}).value().ranks, 0);
  auto both = ParseFlags({"--ranks=2", "--sessions=2"});
  ASSERT_FALSE(both.ok());
  EXPECT_NE(both.status().message().find("--sessions"), std::string::npos) << both.status();
  auto open = ParseFlags({"--ranks=2", "--rate=100"});
  ASSERT_FALSE(open.ok());
  EXPECT_NE(open.status().message().find("--rate"), std::string::npos) << open.status();
  EXPECT_EQ(ParseFlags({"--ranks=0"}).value().sessions, 1);  // 0: off
  EXPECT_FALSE(ParseFlags({"--ranks=-1"}).ok());
  EXPECT_FALSE(ParseFlags({"--ranks=65"}).ok());
}

TEST(ParseFlags, DefaultsToTheMeasuredWinners) {
  const LoadConfig c = *ParseFlags({});
  EXPECT_TRUE(c.stream);
  EXPECT_EQ(c.target, "unix:///tmp/epsd.sock");
  EXPECT_TRUE(c.arrivals.closed_loop());
  EXPECT_FALSE(ParseFlags({"--mode=unary"}).value().stream);
}

TEST(ParseFlags, AsyncRepliesNeedDeviceBuffers) {
  EXPECT_FALSE(ParseFlags({}).value().reply_async);
  EXPECT_TRUE(ParseFlags({"--backend=cuda", "--reply=async"}).value().reply_async);
  auto cpu = ParseFlags({"--reply=async"});
  ASSERT_FALSE(cpu.ok());
  EXPECT_NE(cpu.status().message().find("--reply=async"), std::string::npos) << cpu.status();
  EXPECT_NE(cpu.status().message().find("--backend=cuda"), std::string::npos) << cpu.status();
  EXPECT_FALSE(ParseFlags({"--reply=later"}).ok());
}

TEST(CreateBufferSet, HostBuffersRefuseTheAsyncFenceClearly) {
  const LoadConfig c = *ParseFlags({"--preset=smollm2-135m"});
  auto set = CreateBufferSet(c.backend, c.model,
                             {.num_slots = 8, .max_seqs = 1, .max_context = 1024, .max_batch = 1});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_FALSE((*set)->supports_async());
  const absl::Status st = (*set)->SignalInputsReady(1);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("--backend=cuda"), std::string::npos) << st;
}

TEST(ParseFlags, CustomShapeFlagsOverrideThePresetInAnyOrder) {
  const LoadConfig c = *ParseFlags({"--layers=4", "--preset=smollm2-135m", "--kv-heads=1"});
  EXPECT_EQ(c.model.num_layers, 4);
  EXPECT_EQ(c.model.num_kv_heads, 1);
  EXPECT_EQ(c.model.num_q_heads, 9);
}

TEST(ParseFlags, RejectsAShapeTheServerWouldRefuseNamingTheFlagAndCoresReason) {
  // Once eps-load kept its own copy of core's ranges and relations, in its own words.
  for (const auto& [args, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--preset=llama-3-8b", "--kv-heads=5"},
            "--kv-heads=5: num_q_heads=32 is not a multiple of num_kv_heads=5"},
           {{"--q-heads=30"}, "--q-heads=30: num_q_heads=30 is not a multiple of num_kv_heads=8"},
           {{"--eps-dim=100"}, "--eps-dim=100: sketch_dim=100 not in [1, 64]"},
           {{"--sketch-dim=100"}, "--eps-dim=100: sketch_dim=100 not in [1, 64]"},
           {{"--head-dim=4096"}, "--head-dim=4096: head_dim=4096 not in [4, 1024]"},
           {{"--head-dim=6"}, "--head-dim=6: head_dim=6 is not a multiple of 4"},
           {{"--layers=-1"}, "--layers=-1: num_layers=-1 not in [1, 4096]"},
           {{"--eps-group-blocks=2000"},
            "--eps-group-blocks=2000: group_blocks=2000 not in [1, 1024]"}}) {
    auto c = ParseFlags(args);
    ASSERT_FALSE(c.ok()) << args[0];
    EXPECT_EQ(c.status().message(), message);
  }
}

// One shape flag's values: 0 (the preset's), and values on both sides of core's bounds.
struct ShapeFlagValues {
  const char* flag;
  int ModelLayout::*field;
  std::vector<int> values;
};

TEST(ParseFlags, RefusesExactlyTheShapesCoreRefusesWithCoresReason) {
  // Kept small enough (one token, one row, no more heads than a preset's: the queries are
  // [layers, batch, q_heads, d]) that every shape core accepts needs a few GB at most, so
  // that only core's check can refuse it.
  const std::vector<ShapeFlagValues> flags = {
      {"layers", &ModelLayout::num_layers, {0, -1, 1, 4096, 4097}},
      {"q-heads", &ModelLayout::num_q_heads, {0, -1, 1, 6, 4097}},
      {"kv-heads", &ModelLayout::num_kv_heads, {0, -1, 1, 3, 4097}},
      {"head-dim", &ModelLayout::head_dim, {0, 3, 4, 6, 64, 1024, 1025, 1028}},
      {"block-size", &ModelLayout::block_size, {0, -1, 1, 4096, 4097}},
      {"eps-group-blocks", &ModelLayout::group_blocks, {0, -1, 1, 2, 1024, 1025}},
      {"eps-dim", &ModelLayout::sketch_dim, {0, -1, 1, 64, 65}},
      {"coarse-blocks", &ModelLayout::coarse_blocks, {0, -4, 2, 5, 8, 4096, 4098}},
  };
  const uint64_t seed = std::random_device()();
  SCOPED_TRACE(::testing::Message() << "seed=" << seed);
  std::mt19937_64 rng(seed);
  int refused = 0;
  for (int run = 0; run < 300; ++run) {
    const std::string preset =
        PresetNames()[std::uniform_int_distribution<size_t>(0, PresetNames().size() - 1)(rng)];
    std::vector<std::string> args = {"--preset=" + preset, "--batch=1", "--context=1"};
    ModelLayout model = *PresetModel(preset);
    for (const ShapeFlagValues& f : flags) {
      // Most flags keep the preset's value, so that most shapes break one rule or none.
      if (std::uniform_int_distribution<int>(0, 3)(rng) != 0) continue;
      const int value =
          f.values[std::uniform_int_distribution<size_t>(0, f.values.size() - 1)(rng)];
      args.push_back(absl::StrCat("--", f.flag, "=", value));
      if (value != 0) model.*f.field = value;
    }
    const absl::Status core = model.Validate();
    const absl::StatusOr<LoadConfig> c = ParseFlags(args);
    SCOPED_TRACE(absl::StrJoin(args, " "));
    if (core.ok()) {
      ASSERT_TRUE(c.ok()) << c.status();
      EXPECT_EQ(c->model.DebugString(), model.DebugString());
      continue;
    }
    ++refused;
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string message(c.status().message());
    EXPECT_TRUE(absl::StartsWith(message, "--")) << message;
    EXPECT_TRUE(absl::EndsWith(message, absl::StrCat(": ", core.message()))) << message;
  }
  EXPECT_GT(refused, 0);  // the draw reaches core's refusals
}

TEST(ParseFlags, ReadsTheRunFlags) {
  const LoadConfig c = *ParseFlags(
      {"--target=127.0.0.1:5000", "--batch=4", "--context=uniform:1k-2k", "--duration=2s",
       "--warmup=0", "--rate=poisson:30", "--sessions=3", "--mode=stream", "--deadline=5ms",
       "--json=/tmp/x.json", "--channel-arg=grpc.enable_retries=0", "--soak", "--epsd-pid=12",
       "--channel-arg=grpc.http2.max_pings_without_data=5"});
  EXPECT_EQ(c.target, "127.0.0.1:5000");
  EXPECT_EQ(c.batch, 4);
  EXPECT_EQ(c.context.hi, 2048);
  EXPECT_EQ(c.duration, microseconds(2'000'000));
  EXPECT_EQ(c.warmup, microseconds(0));
  EXPECT_TRUE(c.arrivals.poisson);
  EXPECT_EQ(c.sessions, 3);
  EXPECT_TRUE(c.stream);
  EXPECT_EQ(c.deadline, microseconds(5000));
  EXPECT_EQ(c.json_path, "/tmp/x.json");
  ASSERT_EQ(c.channel_args.size(), 2u);
  EXPECT_EQ(c.channel_args[0].first, "grpc.enable_retries");
  EXPECT_EQ(c.channel_args[0].second, 0);
  EXPECT_EQ(c.channel_args[1].second, 5);
  EXPECT_TRUE(c.soak);
  EXPECT_EQ(c.epsd_pid, 12);
}

TEST(ParseFlags, NamesTheOffendingFlag) {
  for (const auto& [arg, name] :
       std::vector<std::pair<std::string, std::string>>{{"--batch=0", "--batch"},
                                                        {"--mode=fast", "--mode"},
                                                        {"--preset=gpt-5", "--preset"},
                                                        {"--duration=0s", "--duration"},
                                                        {"--channel-arg=nokey", "--channel-arg"},
                                                        {"--bogus=1", "--bogus"},
                                                        {"--backend=tpu", "--backend"}}) {
    auto c = ParseFlags({arg});
    ASSERT_FALSE(c.ok()) << arg;
    EXPECT_NE(c.status().message().find(name), std::string::npos) << c.status();
  }
}

// A target gRPC would only fail to resolve (or dial somewhere else) once the run's calls
// start is a bad flag, found before the run.
TEST(ParseFlags, RefusesATargetThatIsNeitherAUnixPathNorHostPort) {
  for (const std::string target :
       {"localhost", "garbage", "h:99999", "h:", "h:0", "h:abc", "unix://", "unix:///",
        "unix://rel.sock", "unix:rel.sock", "unix-abstract:x", "dns:///h:1", "[::1]"}) {
    auto c = ParseFlags({"--target=" + target});
    ASSERT_FALSE(c.ok()) << target;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << target;
    EXPECT_NE(c.status().message().find("--target=" + target), std::string::npos) << c.status();
  }
}

TEST(ParseFlags, AcceptsAUnixPathOrHostPortTarget) {
  for (const std::string target :
       {"unix:///tmp/epsd.sock", "127.0.0.1:5000", "localhost:50051", "[::1]:7", "epsd-0.ns:1"}) {
    auto c = ParseFlags({"--target=" + target});
    ASSERT_TRUE(c.ok()) << target << ": " << c.status();
    EXPECT_EQ(c->target, target);
  }
}

TEST(CreateBufferSet, CudaWithoutADeviceIsAClearPreconditionError) {
  const LoadConfig c = *ParseFlags({"--preset=smollm2-135m", "--backend=cuda"});
  auto set = CreateBufferSet(c.backend, c.model,
                             {.num_slots = 8, .max_seqs = 1, .max_context = 1024, .max_batch = 1});
  if (set.ok()) {  // a machine with a GPU: device buffers, attached as cuda
    EXPECT_EQ((*set)->backend(), v1::BACKEND_CUDA);
    EXPECT_TRUE((*set)->Descriptors().summary_pool().has_cuda_ipc());
    return;
  }
  EXPECT_EQ(set.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(set.status().message().find("--backend=cuda"), std::string::npos) << set.status();
}

}  // namespace
}  // namespace eps::load

namespace eps::load {
namespace {

// Flags within their ranges asked for a workload image of hundreds of TB, and eps-load
// ended in std::bad_alloc (exit 134) before checking anything; refused at flag reading.
TEST(ParseFlags, AWorkloadBeyondThisMachinesMemoryIsRefusedNamingTheFlags) {
  const absl::StatusOr<LoadConfig> huge =
      ParseFlags({"--block-size=1", "--eps-group-blocks=1", "--head-dim=1024", "--context=16M"});
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(huge.status().message().find("--context=16777216"), std::string::npos) << huge.status();
  EXPECT_NE(huge.status().message().find("more than this machine's"), std::string::npos)
      << huge.status();
  EXPECT_TRUE(ParseFlags({"--batch=2", "--context=8k"}).ok());  // the usual shapes fit
}

}  // namespace
}  // namespace eps::load
