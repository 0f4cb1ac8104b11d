#include "service/config.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "service/server.h"

namespace eps::service {
namespace {

TEST(ConfigTest, DefaultsListenOnAUnixSocketWithAutoBackend) {
  auto config = ParseFlags({});
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->listen, "unix:///tmp/epsd.sock");
  EXPECT_EQ(config->backend, BackendKind::kAuto);
  EXPECT_EQ(config->policy.method, Method::kQuestClt);
  EXPECT_EQ(config->socket_mode, 0660u);
}

TEST(ConfigTest, ParsesEveryEpsFlagInBothForms) {
  auto config = ParseFlags({"--eps-method=quest", "--eps-dim", "16", "--eps-alpha=1.5",
                            "--eps-first-n=2", "--eps-last-n=3", "--eps-top-pages=32",
                            "--eps-heads=retrieval", "--eps-group-blocks=4", "--eps-strict",
                            "--backend=cpu", "--listen=127.0.0.1:7000", "--lease-ms=500"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->policy.method, Method::kQuest);
  EXPECT_EQ(config->sketch_dim, 16);
  EXPECT_FLOAT_EQ(config->policy.alpha, 1.5f);
  EXPECT_EQ(config->policy.first_n, 2);
  EXPECT_EQ(config->policy.last_n, 3);
  EXPECT_EQ(config->policy.top_pages, 32);
  EXPECT_EQ(config->policy.heads, HeadMode::kRetrieval);
  EXPECT_EQ(config->group_blocks, 4);
  EXPECT_TRUE(config->policy.strict);
  EXPECT_EQ(config->backend, BackendKind::kCpu);
  EXPECT_EQ(config->lease_ms, 500u);
}

TEST(ConfigTest, ParsesTheMassBudgetFlags) {
  auto config =
      ParseFlags({"--eps-budget=mass", "--eps-budget-mass=0.9", "--eps-mass-temperature=0.5",
                  "--eps-min-pages=2", "--eps-max-pages=64", "--eps-mass-scope=list"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->policy.budget, Budget::kMass);
  EXPECT_FLOAT_EQ(config->policy.mass_target, 0.9f);
  EXPECT_FLOAT_EQ(config->policy.mass_temperature, 0.5f);
  EXPECT_EQ(config->policy.min_pages, 2);
  EXPECT_EQ(config->policy.max_pages, 64);
  EXPECT_EQ(config->policy.mass_scope, MassScope::kList);
  EXPECT_EQ(ParseFlags({})->policy.mass_scope, MassScope::kHead);
  EXPECT_EQ(ParseFlags({"--eps-budget-mass=0"}).status().message(),
            "--eps-budget-mass=0: want a number in (0, 1]");
  EXPECT_EQ(ParseFlags({"--eps-mass-scope=layer"}).status().message(),
            "--eps-mass-scope=layer: want one of head, list");
}

TEST(ConfigTest, FloatPolicyFlagsAreCheckedAsTheFloatsTheyBecome) {
  // 1e-300 is in (0, 1] as a double and 0 as a float: once it passed here and was refused
  // by the policy's check, which does not name the flag.
  for (const char* flag : {"eps-top-p", "eps-budget-mass", "eps-mass-temperature"}) {
    const std::string arg = absl::StrCat("--", flag, "=1e-300");
    const auto parsed = ParseFlags({arg});
    ASSERT_FALSE(parsed.ok()) << arg;
    EXPECT_TRUE(absl::StartsWith(parsed.status().message(), arg + ": want a number in (0, "))
        << parsed.status();
    EXPECT_TRUE(absl::StrContains(parsed.status().message(), "that is not 0 as a float"))
        << parsed.status();
  }
  // Above the range is not an underflow: the message says only the range.
  const auto above = ParseFlags({"--eps-top-p=1.0000001"});
  ASSERT_FALSE(above.ok());
  EXPECT_FALSE(absl::StrContains(above.status().message(), "as a float")) << above.status();
  auto config = ParseFlags({"--eps-top-p=1e-30", "--eps-budget=top_p"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FLOAT_EQ(config->policy.top_p, 1e-30f);
}

TEST(ConfigTest, CoarseCandidatesDefaultToTwoAndAreRangeChecked) {
  EXPECT_FLOAT_EQ(ParseFlags({})->policy.coarse_candidates, 2.0f);
  auto config = ParseFlags({"--eps-coarse-candidates=3.5"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_FLOAT_EQ(config->policy.coarse_candidates, 3.5f);
  EXPECT_EQ(ParseFlags({"--eps-coarse-candidates=0.5"}).status().message(),
            "--eps-coarse-candidates=0.5: want a number in [1, 1024]");
  EXPECT_EQ(ParseFlags({"--eps-coarse-candidates=2000"}).status().message(),
            "--eps-coarse-candidates=2000: want a number in [1, 1024]");
  EXPECT_FALSE(ParseFlags({"--eps-coarse-candidates=nan"}).ok());
}

TEST(ConfigTest, RefusesEpsFlagsThatNoLayoutCanServeAtStartup) {
  // Each flag is valid alone; together every Attach would fail.
  EXPECT_EQ(ParseFlags({"--eps-strict", "--eps-budget=fixed"}).status().message(),
            "the --eps-* flags do not make a selection policy: strict mode replaces the budget "
            "rule; budget=fixed");
  EXPECT_EQ(ParseFlags({"--eps-min-pages=8", "--eps-max-pages=4"}).status().message(),
            "the --eps-* flags do not make a selection policy: min_pages=8 exceeds max_pages=4");
  // What depends on the engine's layout is left to its Attach.
  EXPECT_TRUE(ParseFlags({"--eps-method=1pc"}).ok());
  EXPECT_TRUE(ParseFlags({"--eps-heads=retrieval"}).ok());
  EXPECT_TRUE(ParseFlags({"--eps-strict", "--eps-budget=threshold"}).ok());
}

TEST(ConfigTest, RejectsUnknownFlagsAndBadValuesNamingThem) {
  EXPECT_EQ(ParseFlags({"--eps-methd=jl"}).status().message(), "unknown flag --eps-methd");
  EXPECT_EQ(ParseFlags({"--eps-method=best"}).status().message(),
            "--eps-method=best: want off, jl, 1pc, fro, quest or questclt");
  EXPECT_FALSE(ParseFlags({"--eps-alpha=0.5"}).ok());
  EXPECT_FALSE(ParseFlags({"--eps-dim=0"}).ok());
  EXPECT_FALSE(ParseFlags({"--eps-top-pages"}).ok());
  EXPECT_FALSE(ParseFlags({"stray"}).ok());
  EXPECT_FALSE(ParseFlags({"--eps-strict=maybe"}).ok());
}

TEST(ConfigTest, FlagNamesListEveryAcceptedFlag) {
  for (const std::string& name : FlagNames()) {
    if (name == "help") continue;
    EXPECT_NE(Usage().find("--" + name), std::string::npos) << name;
  }
  EXPECT_GE(FlagNames().size(), 20u);
}

TEST(ConfigTest, TcpListenIsLoopbackOnlyUnlessAllowed) {
  EXPECT_TRUE(CheckListenAddress("listen", "unix:///tmp/x.sock", false).ok());
  EXPECT_TRUE(CheckListenAddress("listen", "127.0.0.1:5000", false).ok());
  EXPECT_TRUE(CheckListenAddress("listen", "[::1]:5000", false).ok());
  EXPECT_TRUE(CheckListenAddress("listen", "localhost:5000", false).ok());
  EXPECT_FALSE(CheckListenAddress("listen", "0.0.0.0:5000", false).ok());
  EXPECT_TRUE(CheckListenAddress("listen", "0.0.0.0:5000", true).ok());
  EXPECT_FALSE(CheckListenAddress("listen", "unix://", false).ok());
  EXPECT_FALSE(CheckListenAddress("listen", "unix://relative.sock", false).ok());
}

TEST(ConfigTest, AHostNameThatStartsLike127IsNotLoopback) {
  // "127.*" once matched as text: a name such as 127.example.com resolves to whatever DNS
  // says, and every listener bound it without --allow-remote.
  for (const char* flag : {"--listen", "--metrics-listen", "--health-listen"}) {
    const auto parsed = ParseFlags({absl::StrCat(flag, "=127.example.com:5000")});
    ASSERT_FALSE(parsed.ok()) << flag;
    EXPECT_EQ(parsed.status().message(),
              absl::StrCat(flag,
                           "=127.example.com:5000 is not a Unix socket or a loopback "
                           "address; pass --allow-remote"));
  }
  EXPECT_TRUE(ParseFlags({"--listen=127.example.com:5000", "--allow-remote"}).ok());
  // Every IPv4 spelling of an address in 127/8 still is.
  for (const char* loopback : {"127.0.0.1:5000", "127.255.255.254:5000", "127.1:5000"}) {
    EXPECT_TRUE(CheckListenAddress("listen", loopback, false).ok()) << loopback;
  }
  EXPECT_FALSE(CheckListenAddress("listen", "128.0.0.1:5000", false).ok());
}

TEST(ConfigTest, MetricsListenDefaultsToLoopbackAndOffOrEmptyDisablesIt) {
  EXPECT_EQ(ParseFlags({})->metrics_listen, "127.0.0.1:9464");
  EXPECT_EQ(ParseFlags({"--metrics-listen=off"})->metrics_listen, "");
  EXPECT_EQ(ParseFlags({"--metrics-listen="})->metrics_listen, "");
  EXPECT_EQ(ParseFlags({"--metrics-listen", "0.0.0.0:0", "--allow-remote"})->metrics_listen,
            "0.0.0.0:0");
  EXPECT_EQ(ParseFlags({"--metrics-listen=127.0.0.1:70000"}).status().message(),
            "--metrics-listen=127.0.0.1:70000: want host:port (port in [0, 65535]), empty or off");
  EXPECT_FALSE(ParseFlags({"--metrics-listen=9464"}).ok());
}

TEST(ConfigTest, MetricsListenRefusesIPv6ItsHttpServerCannotBind) {
  // They passed the syntax check, then civetweb failed to bind: "is the port in use?".
  for (const char* v6 : {"[::1]:9464", "[::]:0"}) {
    EXPECT_EQ(
        ParseFlags({std::string("--metrics-listen=") + v6, "--allow-remote"}).status().message(),
        std::string("--metrics-listen=") + v6 +
            ": want an IPv4 address or host name and a port: /metrics is served over IPv4 "
            "only (0.0.0.0 for every interface)");
  }
  EXPECT_EQ(ParseFlags({"--health-listen=[::1]:0"})->health_listen, "[::1]:0");
  EXPECT_EQ(ParseFlags({"--metrics-listen=localhost:0"})->metrics_listen, "localhost:0");
}

TEST(ConfigTest, ListenTakesAUnixPathOrHostAndPortAndNamesItself) {
  EXPECT_TRUE(ParseFlags({"--listen=127.0.0.1:0"}).ok());
  EXPECT_TRUE(ParseFlags({"--listen=localhost:5000"}).ok());
  EXPECT_TRUE(ParseFlags({"--listen=[::1]:65535"}).ok());
  EXPECT_TRUE(ParseFlags({"--listen=unix:///tmp/x.sock"}).ok());
  // Each once listened somewhere else (99999 wrapped to 34463, no port meant 443) or
  // failed only in gRPC.
  for (const char* bad : {"127.0.0.1:99999", "localhost", "127.0.0.1:", "127.0.0.1:abc",
                          "127.0.0.1:+80", ":5000", "unix:", "unix://"}) {
    const auto parsed = ParseFlags({std::string("--listen=") + bad});
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().message().rfind(std::string("--listen=") + bad + ": want", 0), 0u)
        << parsed.status();
  }
}

TEST(ConfigTest, ListenTakesOnlyAnAbsoluteUnixSocketPath) {
  // unix://relative.sock bound ./relative.sock, which no client can dial: for them
  // unix://relative names an authority (cli::CheckDialTarget refuses it).
  for (const char* bad : {"unix://relative.sock", "unix://run/eps.sock", "unix:///"}) {
    EXPECT_EQ(
        ParseFlags({std::string("--listen=") + bad}).status().message(),
        std::string("--listen=") + bad + ": want unix:///path: an absolute path after unix://")
        << bad;
  }
  EXPECT_TRUE(ParseFlags({"--listen=unix:///x.sock"}).ok());
}

TEST(ConfigTest, HelpStillChecksListenSoThatTheDeployFlagCheckCatchesIt) {
  EXPECT_FALSE(ParseFlags({"--help", "--listen=localhost"}).ok());
  EXPECT_FALSE(ParseFlags({"--listen=127.0.0.1:99999", "--help"}).ok());
}

TEST(ConfigTest, ListenRefusesUnixSchemesOtherThanSlashSlash) {
  for (const char* bad : {"unix:/tmp/x.sock", "unix:x.sock", "unix-abstract:epsd", "unix:123"}) {
    const auto parsed = ParseFlags({std::string("--listen=") + bad});
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_NE(parsed.status().message().find("unix-abstract: are not supported"), std::string::npos)
        << parsed.status();
    EXPECT_EQ(parsed.status().message().find("--allow-remote"), std::string::npos)
        << parsed.status();
  }
  EXPECT_FALSE(CheckListenAddress("listen", "unix:/tmp/x.sock", true).ok());
}

TEST(ConfigTest, ListenRefusesAUnixPathLongerThanASocketAddress) {
  EXPECT_TRUE(ParseFlags({"--listen=unix:///" + std::string(106, 'x')}).ok());
  const auto parsed = ParseFlags({"--listen=unix:///" + std::string(107, 'x')});
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("at most 107 bytes (this one has 108)"),
            std::string::npos)
      << parsed.status();
}

TEST(ConfigTest, SocketModeTakesOctalDigitsOnly) {
  EXPECT_EQ(ParseFlags({"--socket-mode=0600"})->socket_mode, 0600u);
  EXPECT_EQ(ParseFlags({"--socket-mode=660"})->socket_mode, 0660u);
  EXPECT_EQ(ParseFlags({"--socket-mode=00640"})->socket_mode, 0640u);
  for (const char* bad : {"+0660", " 660", "-1", "0x1ff", "0800", "1000", "", "77777777777"}) {
    EXPECT_EQ(ParseFlags({std::string("--socket-mode=") + bad}).status().message(),
              std::string("--socket-mode=") + bad + ": want octal digits, at most 0777")
        << bad;
  }
}

TEST(ConfigTest, ByteLimitsTakeTheTerabyteSuffixTheirRangesName) {
  EXPECT_EQ(ParseFlags({"--max-session-bytes=1T"})->max_session_bytes, uint64_t{1} << 40);
  EXPECT_EQ(ParseFlags({"--max-server-bytes=4T"})->max_server_bytes, uint64_t{4} << 40);
  EXPECT_EQ(ParseFlags({"--max-session-bytes=2T"}).status().message(),
            "--max-session-bytes=2T: want a size in [1M, 1T] (k, M, G, T are powers of 1024)");
}

TEST(ConfigTest, StepLogTakesAPathAndIsOffByDefaultOrEmpty) {
  EXPECT_EQ(ParseFlags({})->step_log, "");
  EXPECT_EQ(ParseFlags({"--step-log=/tmp/steps.jsonl"})->step_log, "/tmp/steps.jsonl");
  EXPECT_EQ(ParseFlags({"--step-log="})->step_log, "");
}

}  // namespace
}  // namespace eps::service
