// The shared command-line parser (cli/flags.h): how values are taken. The flags below are this
// test's own; ParseArgs resets them to their defaults.
#include "cli/flags.h"

#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "gtest/gtest.h"

ABSL_FLAG(std::string, step_log, "", "a path");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464", "host:port");
ABSL_FLAG(int, count, 0, "a signed count");

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

}  // namespace
}  // namespace eps::cli
