#include "service/telemetry/otlp_encode.h"

#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace eps::telemetry {
namespace {

const std::string kFffd = "\xEF\xBF\xBD";  // U+FFFD

// The backstop: whatever a span holds, the encoded request parses under protobuf's strict
// proto3 UTF-8 check (as the Collector and the official Python package parse it).
TEST(OtlpEncodeTest, EveryStringItWritesIsValidUtf8) {
  const std::string bad = "x\xFF\xC3";
  SpanRecord span;
  span.trace_id = NewTraceId();
  span.span_id = NewSpanId();
  span.name = bad;
  span.trace_state = "k=" + bad;
  span.attributes.push_back({bad, bad});
  span.error = true;
  span.status_message = bad;
  const auto request = EncodeSpans({{bad, bad}}, {span});
  opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(request.SerializeAsString()));
  const auto& out = parsed.resource_spans(0).scope_spans(0).spans(0);
  EXPECT_EQ(out.name(), "x" + kFffd + kFffd);
  EXPECT_EQ(out.trace_state(), "k=x" + kFffd + kFffd);
  EXPECT_EQ(out.status().message(), "x" + kFffd + kFffd);
  EXPECT_EQ(out.attributes(0).key(), "x" + kFffd + kFffd);
  EXPECT_EQ(parsed.resource_spans(0).resource().attributes(0).value().string_value(),
            "x" + kFffd + kFffd);
}

// The batch span processor cuts batches by these bounds: a request must never be larger than
// the bounds of its spans say, whatever the spans hold.
TEST(OtlpEncodeTest, ARequestIsNoLargerThanItsSpansBoundsSay) {
  const uint64_t seed = eps::testing::TestSeed();
  SCOPED_TRACE(eps::testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const auto text = [&](size_t max) {
    std::string s(rng() % (max + 1), 'a');
    for (char& c : s) c = static_cast<char>(rng() % 256);  // bytes: often not UTF-8
    return s;
  };
  const std::vector<std::pair<std::string, std::string>> resource = {{"service.name", "epsd"},
                                                                     {text(40), text(40)}};
  const size_t empty = EncodeSpans(resource, {}).ByteSizeLong();
  for (int round = 0; round < 50; ++round) {
    std::vector<SpanRecord> spans(1 + rng() % 20);
    size_t bound = 0;
    for (SpanRecord& s : spans) {
      s.trace_id = NewTraceId();
      s.span_id = NewSpanId();
      if (rng() % 2) s.parent_span_id = NewSpanId();
      s.trace_state = text(100);
      s.name = text(60);
      s.kind = rng() % 2 ? SpanKind::kServer : SpanKind::kInternal;
      s.start_unix_ns = rng();
      s.end_unix_ns = rng();
      for (int a = static_cast<int>(rng() % 20); a > 0; --a) {
        switch (rng() % 4) {
          case 0:
            s.attributes.push_back({text(30), text(3000)});
            break;
          case 1:
            s.attributes.push_back({text(30), static_cast<int64_t>(rng())});
            break;
          case 2:
            s.attributes.push_back({text(30), 0.5});
            break;
          default:
            s.attributes.push_back({text(30), true});
            break;
        }
      }
      s.error = rng() % 2;
      s.status_message = text(300);
      bound += EncodedSizeBound(s);
    }
    EXPECT_LE(EncodeSpans(resource, spans).ByteSizeLong(), empty + kEncodedRequestSlack + bound)
        << "round " << round;
  }
}

}  // namespace
}  // namespace eps::telemetry
