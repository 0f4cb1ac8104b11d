#include "service/telemetry/otel_config.h"

#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace eps::telemetry {
namespace {

EnvLookup Env(std::map<std::string, std::string> values) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(std::move(values));
  return [shared](const char* name) -> const char* {
    const auto it = shared->find(name);
    return it == shared->end() ? nullptr : it->second.c_str();
  };
}

TEST(OtelConfigTest, TracesAreOffUntilAnEndpointIsGiven) {
  const auto c = TraceConfigFromEnv(Env({}));
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->enabled);
  EXPECT_EQ(c->resource.front(), (std::pair<std::string, std::string>{"service.name", "epsd"}));
  EXPECT_EQ(c->batch.schedule_delay.count(), 5000);  // the spec's OTEL_BSP_* defaults
  EXPECT_EQ(c->batch.export_timeout.count(), 30000);
  EXPECT_EQ(c->batch.max_queue_size, 2048u);
  EXPECT_EQ(c->batch.max_export_batch_size, 512u);
  EXPECT_EQ(c->timeout.count(), 10000);
  EXPECT_TRUE(TraceConfigFromEnv(Env({{"OTEL_TRACES_EXPORTER", "otlp"}}))->enabled);
}

TEST(OtelConfigTest, SdkDisabledAndExporterNoneWinOverAnEndpoint) {
  EXPECT_FALSE(TraceConfigFromEnv(Env({{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"},
                                       {"OTEL_SDK_DISABLED", "true"}}))
                   ->enabled);
  EXPECT_FALSE(TraceConfigFromEnv(Env({{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"},
                                       {"OTEL_TRACES_EXPORTER", "none"}}))
                   ->enabled);
}

TEST(OtelConfigTest, GrpcEndpointDefaultsToPort4317AndTlsFollowsTheScheme) {
  const auto c = TraceConfigFromEnv(Env({{"OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector"}}));
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->enabled);
  EXPECT_EQ(c->protocol, OtlpProtocol::kGrpc);
  EXPECT_TRUE(c->endpoint.tls);
  EXPECT_EQ(c->endpoint.authority(), "collector:4317");
  EXPECT_EQ(TraceConfigFromEnv(Env({{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://[::1]:5555"}}))
                ->endpoint.authority(),
            "[::1]:5555");
}

TEST(OtelConfigTest, HttpAppendsV1TracesToTheGeneralEndpointOnly) {
  auto c = TraceConfigFromEnv(Env({{"OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"},
                                   {"OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/base/"}}));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->endpoint.path, "/base/v1/traces");
  c = TraceConfigFromEnv(Env({{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"},
                              {"OTEL_EXPORTER_OTLP_ENDPOINT", "http://ignored:1"},
                              {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:9/custom"}}));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->endpoint.host, "c");
  EXPECT_EQ(c->endpoint.port, 9);
  EXPECT_EQ(c->endpoint.path, "/custom");
}

TEST(OtelConfigTest, UnsupportedSettingsAreErrorsNamingTheVariable) {
  auto c = TraceConfigFromEnv(Env({{"OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"}}));
  EXPECT_NE(c.status().message().find("OTEL_EXPORTER_OTLP_PROTOCOL=http/json"), std::string::npos);
  // The traces variable, which wins, is the one named (it was named the general one's).
  c = TraceConfigFromEnv(Env({{"OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"},
                              {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"}}));
  EXPECT_NE(c.status().message().find("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/json"),
            std::string::npos)
      << c.status();
  c = TraceConfigFromEnv(Env({{"OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"},
                              {"OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4318"}}));
  EXPECT_NE(c.status().message().find("TLS"), std::string::npos);
  c = TraceConfigFromEnv(Env({{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:99999"}}));
  EXPECT_NE(c.status().message().find("bad port"), std::string::npos);
  c = TraceConfigFromEnv(Env({{"OTEL_RESOURCE_ATTRIBUTES", "novalue"}}));
  EXPECT_NE(c.status().message().find("OTEL_RESOURCE_ATTRIBUTES"), std::string::npos);
}

TEST(OtelConfigTest, AnEndpointWhoseHostOrPathCannotGoIntoARequestIsAnError) {
  // A space or CR/LF in the path went into the OTLP/HTTP request line as it was, a host
  // with a space failed every export's lookup, and junk after an IPv6 ']' was ignored.
  for (const char* url : {"http://c:4318/v1 traces", "http://c:4318/v1\r\nX-A: 1",
                          "http://c d:4318", "http://[::1]junk", "http://c/\x01"}) {
    const auto c = TraceConfigFromEnv(Env({{"OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"},
                                           {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url}}));
    ASSERT_FALSE(c.ok()) << url;
    EXPECT_TRUE(absl::StartsWith(c.status().message(), "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="))
        << c.status().message();
  }
  // What they may be.
  for (const char* url : {"http://collector-0.otel_ns.svc:4318/v1/traces?x=%20y",
                          "http://[fe80::1%25eth0]:4318/p", "http://10.0.0.7/"}) {
    const auto c = TraceConfigFromEnv(Env({{"OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"},
                                           {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", url}}));
    EXPECT_TRUE(c.ok()) << url << ": " << c.status();
  }
}

TEST(OtelConfigTest, BadNumbersWarnAndKeepTheDefault) {
  const auto c = TraceConfigFromEnv(Env({{"OTEL_BSP_MAX_QUEUE_SIZE", "lots"},
                                         {"OTEL_BSP_SCHEDULE_DELAY", "250"},
                                         {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "-3"}}));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->batch.max_queue_size, 2048u);
  EXPECT_EQ(c->batch.schedule_delay.count(), 250);
  EXPECT_EQ(c->timeout.count(), 10000);
  EXPECT_EQ(c->warnings.size(), 2u);
}

TEST(OtelConfigTest, ADurationPastTwoToThe31MillisecondsWarnsAndKeepsTheDefault) {
  // A value "large enough to mean never" once wrapped when the processor added it to the
  // clock in nanoseconds: OTEL_EXPORTER_OTLP_TIMEOUT=9223372036854775807 gave every export
  // a deadline before it began, and no span was ever exported.
  const auto c = TraceConfigFromEnv(Env({{"OTEL_EXPORTER_OTLP_TIMEOUT", "9223372036854775807"},
                                         {"OTEL_BSP_SCHEDULE_DELAY", "2147483648"},
                                         {"OTEL_BSP_EXPORT_TIMEOUT", "2147483647"}}));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->timeout.count(), 10000);
  EXPECT_EQ(c->batch.schedule_delay.count(), 5000);
  EXPECT_EQ(c->batch.export_timeout.count(), 2147483647);  // the largest taken
  ASSERT_EQ(c->warnings.size(), 2u);
  EXPECT_EQ(c->warnings[0],
            "OTEL_EXPORTER_OTLP_TIMEOUT=9223372036854775807 is not a duration in ms in [0, "
            "2147483647]; using 10000");
}

TEST(OtelConfigTest, HeadersThatGrpcOrHttpCannotCarryAreErrorsNamingTheVariable) {
  // gRPC aborted epsd at the first export with such metadata ("API misuse"), and a CR or LF
  // split the OTLP/HTTP request.
  for (const char* headers : {"api key=x", "a/b=x", "x-user=Jos%C3%A9", "x-a=1%0D%0Ax-b: 2",
                              "x-a=tab%09in", "%3Apath=x"}) {
    for (const char* variable :
         {"OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"}) {
      const auto c = TraceConfigFromEnv(
          Env({{"OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"}, {variable, headers}}));
      ASSERT_FALSE(c.ok()) << variable << "=" << headers;
      EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_TRUE(absl::StartsWith(c.status().message(), absl::StrCat(variable, ": ")))
          << c.status().message();
    }
  }
  // What both carry: upper case is lowered, spaces inside a value are printable.
  const auto c = TraceConfigFromEnv(Env(
      {{"OTEL_EXPORTER_OTLP_HEADERS", "X-Scope.OrgID_1=tenant a,authorization=Basic%20dXM6cA=="}}));
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->headers.size(), 2u);
  EXPECT_EQ(c->headers[0], (std::pair<std::string, std::string>{"x-scope.orgid_1", "tenant a"}));
  EXPECT_EQ(c->headers[1].second, "Basic dXM6cA==");
}

TEST(OtelConfigTest, AScheduleDelayBelowOneMillisecondIsRaisedToItWithAWarning) {
  const auto c = TraceConfigFromEnv(Env({{"OTEL_BSP_SCHEDULE_DELAY", "0"}}));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->batch.schedule_delay.count(), 1);
  ASSERT_EQ(c->warnings.size(), 1u);
  EXPECT_EQ(c->warnings[0], "OTEL_BSP_SCHEDULE_DELAY=0 is below 1 ms; using 1");
}

TEST(OtelConfigTest, ServiceNameVariableWinsOverTheResourceAttribute) {
  const auto c =
      TraceConfigFromEnv(Env({{"OTEL_SERVICE_NAME", "sidecar"},
                              {"OTEL_RESOURCE_ATTRIBUTES", "service.name=x, host.name=node%2D7"},
                              {"OTEL_EXPORTER_OTLP_HEADERS", "Authorization=Bearer%20t,X-A=1"}}));
  ASSERT_TRUE(c.ok());
  ASSERT_EQ(c->resource.size(), 2u);
  EXPECT_EQ(c->resource[0].second, "sidecar");
  EXPECT_EQ(c->resource[1], (std::pair<std::string, std::string>{"host.name", "node-7"}));
  ASSERT_EQ(c->headers.size(), 2u);
  EXPECT_EQ(c->headers[0], (std::pair<std::string, std::string>{"authorization", "Bearer t"}));
}

}  // namespace
}  // namespace eps::telemetry
