// The shared command-line parser (cli/flags.h): how values are taken and how errors name
// them. The flags below are this test's own; ParseArgs resets them to their defaults.
#include "cli/flags.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

ABSL_FLAG(std::string, step_log, "", "a path");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464", "host:port");
ABSL_FLAG(int, count, 0, "a signed count");
ABSL_FLAG(int, first_n, 1, "groups always visited, in [0, 2^30]");
ABSL_FLAG(int64_t, sessions, 1, "sessions");
ABSL_FLAG(eps::cli::Millis, wait_ms, {absl::Milliseconds(5)}, "a wait");

namespace eps::cli {
namespace {

absl::Status Parse(const std::vector<std::string>& args) {
  CommandLine command_line;
  return ParseArgs(args, &command_line);
}

TEST(ParseArgsTest, ASeparateValueThatStartsWithDashDashIsAForgottenValue) {
  // Once: a step log named "--metrics-listen=off", and the metrics flag dropped.
  const absl::Status s = Parse({"--step-log", "--metrics-listen=off"});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message().rfind("--step-log needs a value", 0), 0u) << s;
  EXPECT_NE(s.message().find("--step-log=VALUE"), std::string::npos) << s;
  EXPECT_EQ(absl::GetFlag(FLAGS_step_log), "");
}

TEST(ParseArgsTest, AValueThatStartsWithDashDashIsWrittenWithAnEqualsSign) {
  ASSERT_TRUE(Parse({"--step-log=--odd-name", "--metrics-listen", "off"}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_step_log), "--odd-name");
  EXPECT_EQ(absl::GetFlag(FLAGS_metrics_listen), "off");
}

TEST(ParseArgsTest, ASeparateValueWithOneDashIsStillAValue) {
  ASSERT_TRUE(Parse({"--count", "-3"}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_count), -3);
}

TEST(ParseArgsTest, MillisTakeWholeMillisecondsInAnySpelling) {
  for (const auto& [text, ms] : std::vector<std::pair<std::string, int64_t>>{
           {"250", 250}, {"0", 0}, {"1.5s", 1500}, {"2ms", 2}, {"1m", 60000}, {"3.0", 3}}) {
    ASSERT_TRUE(Parse({"--wait-ms=" + text}).ok()) << text;
    EXPECT_EQ(absl::GetFlag(FLAGS_wait_ms).value, absl::Milliseconds(ms)) << text;
  }
}

TEST(ParseArgsTest, MillisRefuseAFractionOfAMillisecondInsteadOfCuttingItToZero) {
  for (const char* text : {"500us", "0.4", "1.5ms", "2.5"}) {
    EXPECT_EQ(Parse({std::string("--wait-ms=") + text}).message(),
              std::string("--wait-ms=") + text + ": want a whole number of milliseconds")
        << text;
  }
}

TEST(ParseArgsTest, MillisRefuseHexExponentsAndInfinities) {
  // absl::SimpleAtod reads all of these: 0x10 was 16 ms, 1e9 about 278 hours.
  for (const char* text : {"0x10", "1e9", "inf", "nan", "+5", "-5", ".5", "5.", "1_000", ""}) {
    const absl::Status s = Parse({std::string("--wait-ms=") + text});
    EXPECT_FALSE(s.ok()) << text;
    EXPECT_EQ(s.message().rfind(std::string("--wait-ms=") + text + ": want ", 0), 0u) << s;
  }
  EXPECT_FALSE(Parse({"--wait-ms=" + std::string(400, '9')}).ok());
}

TEST(ParseArgsTest, ARangeErrorNamesTheValueAsTyped) {
  ASSERT_TRUE(Parse({"--wait-ms=3600000"}).ok());
  absl::Duration d;
  // Not "--wait-ms=1h": the unparsed form of what was typed.
  EXPECT_EQ(ReadDuration(FLAGS_wait_ms, absl::ZeroDuration(), absl::Minutes(10), &d).message(),
            "--wait-ms=3600000: want a duration in [0, 10m]");
  ASSERT_TRUE(Parse({}).ok());
  EXPECT_EQ(ReadDuration(FLAGS_wait_ms, absl::Milliseconds(10), absl::Minutes(10), &d).message(),
            "--wait-ms=5ms: want a duration in [10ms, 10m]");
}

TEST(ParseArgsTest, AnIntegerTooLargeForItsTypeNamesTheRange) {
  EXPECT_EQ(Parse({"--first-n=3000000000"}).message(),
            "--first-n=3000000000: want an integer in [0, 2^30]");
  EXPECT_EQ(Parse({"--count=-3000000000"}).message(),
            "--count=-3000000000: want an integer in [-2147483648, 2147483647]");
  EXPECT_EQ(Parse({"--sessions=99999999999999999999"}).message(),
            "--sessions=99999999999999999999: want an integer in [-9223372036854775808, "
            "9223372036854775807]");
  EXPECT_EQ(Parse({"--first-n=abc"}).message(), "--first-n=abc: want an integer");
}

}  // namespace
}  // namespace eps::cli
