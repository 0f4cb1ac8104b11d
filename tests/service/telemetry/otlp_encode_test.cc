#include "service/telemetry/otlp_encode.h"

#include <string>

#include "gtest/gtest.h"

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

}  // namespace
}  // namespace eps::telemetry
