#include "service/telemetry/trace_context.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "service/telemetry/sampler.h"

namespace eps::telemetry {
namespace {

constexpr const char* kValid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

TEST(TraceContextTest, ParsesTheSpecExampleAndKeepsTracestate) {
  const auto c = ParseTraceparent(kValid, "congo=t61rcWkgMzE");
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(Hex(c->trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
  EXPECT_EQ(Hex(c->span_id), "00f067aa0ba902b7");
  EXPECT_TRUE(c->sampled());
  EXPECT_EQ(c->trace_state, "congo=t61rcWkgMzE");
  EXPECT_EQ(FormatTraceparent(c->trace_id, c->span_id, c->flags), kValid);
}

TEST(TraceContextTest, RejectsMalformedHeadersSoANewTraceStarts) {
  for (const char* bad :
       {"", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",       // short
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",        // upper case
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",        // zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",        // zero span id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",        // version ff
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  // v0 with more
        "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",        // separator
        "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01"}) {     // not hex
    EXPECT_FALSE(ParseTraceparent(bad).has_value()) << bad;
  }
}

TEST(TraceContextTest, AcceptsAFutureVersionWithMoreFields) {
  EXPECT_TRUE(ParseTraceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-later")
                  .has_value());
  EXPECT_FALSE(
      ParseTraceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00x").has_value());
}

TEST(TraceContextTest, DropsAnOversizedTracestate) {
  std::string members;
  for (int i = 0; i < 20; ++i)
    members += "k" + std::to_string(i) + "=" + std::string(24, 'v') + ",";
  members.pop_back();  // 20 members, 567 bytes: valid, but longer than 512
  ASSERT_TRUE(ParseTracestate(members).has_value());
  EXPECT_EQ(ParseTraceparent(kValid, members)->trace_state, "");
}

TEST(TraceContextTest, TracestateKeepsValidMembersWithoutEmptyOnesOrWhitespace) {
  EXPECT_EQ(ParseTracestate("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
            "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7");
  EXPECT_EQ(ParseTracestate(" a=1 , ,\tb=x y\t,"), "a=1,b=x y");
  EXPECT_EQ(ParseTracestate("0tenant@sys-1=v,a_b-c*d/e=!~"), "0tenant@sys-1=v,a_b-c*d/e=!~");
  EXPECT_EQ(ParseTracestate(""), "");
  std::string thirty_two;
  for (int i = 0; i < 32; ++i) thirty_two += "k" + std::to_string(i) + "=v,";
  EXPECT_TRUE(ParseTracestate(thirty_two).has_value());
  EXPECT_FALSE(ParseTracestate(thirty_two + "k32=v").has_value());
}

// tracestate was copied as sent into Span.trace_state: a byte that is not UTF-8 made a strict
// receiver refuse the whole batch, 81 spans of every engine with it.
TEST(TraceContextTest, AnInvalidTracestateIsDroppedWholeAndTheTraceparentKept) {
  for (const std::string& bad : std::vector<std::string>{
           "k=\xC3\xA9", "k=\xff\xfe\x80", "k=\x7f", "k=\x01", "K=1", "1a=1", "a", "a=", "=1",
           "a=b=c", "a=1,a=2", "a@=1", "a@B=1", "a@abcdefghijklmno=1", std::string(257, 'a') + "=1",
           "a=" + std::string(257, 'v'), "a=1 ,b"}) {
    EXPECT_FALSE(ParseTracestate(bad).has_value()) << bad;
    const auto context = ParseTraceparent(kValid, bad);
    ASSERT_TRUE(context.has_value()) << bad;
    EXPECT_EQ(context->trace_state, "") << bad;
  }
}

TEST(TraceContextTest, NewIdsAreNonZeroAndDistinct) {
  const TraceId a = NewTraceId(), b = NewTraceId();
  EXPECT_NE(a, b);
  EXPECT_NE(a, TraceId{});
  EXPECT_NE(NewSpanId(), SpanId{});
}

TEST(SamplerTest, ParentBasedFollowsTheCallersSampledFlag) {
  const auto s = Sampler::FromNames("parentbased_always_off", "");
  ASSERT_TRUE(s.ok());
  auto parent = ParseTraceparent(kValid);
  EXPECT_TRUE(s->ShouldSample(parent, parent->trace_id));
  parent->flags = 0;
  EXPECT_FALSE(s->ShouldSample(parent, parent->trace_id));
  EXPECT_FALSE(s->ShouldSample(std::nullopt, NewTraceId()));  // a root: always_off
}

TEST(SamplerTest, TraceIdRatioKeepsAboutThatShareOfTraces) {
  const auto s = Sampler::FromNames("traceidratio", "0.25");
  ASSERT_TRUE(s.ok());
  int kept = 0;
  for (int i = 0; i < 20000; ++i) kept += s->ShouldSample(std::nullopt, NewTraceId());
  EXPECT_NEAR(kept / 20000.0, 0.25, 0.02);  // 6.5 standard deviations
  EXPECT_FALSE(Sampler::FromNames("traceidratio", "1.5").ok());
  EXPECT_FALSE(Sampler::FromNames("sometimes", "").ok());
}

// An id whose low 64 bits are all ones is 2^64 - 1: as a double it rounded up to 2^64, which
// is not below ratio 1.0 * 2^64, so traceidratio at 1.0 once dropped it.
TEST(SamplerTest, TraceIdRatioComparesTheIdsLowBitsAsIntegers) {
  TraceId id{};
  id[0] = 1;
  for (int i = 8; i < 16; ++i) id[i] = 0xff;
  const auto all = Sampler::FromNames("traceidratio", "1.0");
  ASSERT_TRUE(all.ok());
  EXPECT_TRUE(all->ShouldSample(std::nullopt, id));
  const auto half = Sampler::FromNames("traceidratio", "0.5");
  ASSERT_TRUE(half.ok());
  EXPECT_FALSE(half->ShouldSample(std::nullopt, id));
  id[8] = 0x7f;  // 2^63 - 1: just below the bound 2^63
  EXPECT_TRUE(half->ShouldSample(std::nullopt, id));
  const auto none = Sampler::FromNames("traceidratio", "0");
  ASSERT_TRUE(none.ok());
  for (int i = 8; i < 16; ++i) id[i] = 0;
  EXPECT_FALSE(none->ShouldSample(std::nullopt, id));
}

}  // namespace
}  // namespace eps::telemetry
