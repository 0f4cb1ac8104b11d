// Command-line handling shared by every eps binary (epsd, eps-load, eps-demo,
// eps_core_demo, eps-health-probe): flags are abseil flags (ABSL_FLAG), defined in
// one file per binary, parsed strictly by ParseArgs, with one set of value types so
// that a flag means the same thing in every binary (docs/cli.md).
//
//   sizes      Size: 32768, 32k, 64M, 1G, 1T (k, M, G, T are powers of 1024)
//   durations  absl::Duration: 2ms, 500us, 1.5s, 10m (a unit is required, except 0);
//              Millis: the same, and a bare decimal number is read in milliseconds,
//              the unit the flag's name carries (--lease-ms=500 or --lease-ms=2s); either way a
//              whole number of that unit (--drain-ms=500us and --drain-ms=0.4 are errors)
//
// Thread safety: ParseArgs writes the process's flags; call it before starting threads.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace eps::cli {

// A count or size: a non-negative integer with an optional binary suffix.
struct Size {
  int64_t value = 0;
};
bool AbslParseFlag(absl::string_view text, Size* out, std::string* error);
std::string AbslUnparseFlag(Size size);

// A duration whose bare number counts milliseconds (flags named *-ms).
struct Millis {
  absl::Duration value;
};
bool AbslParseFlag(absl::string_view text, Millis* out, std::string* error);
std::string AbslUnparseFlag(Millis d);

// An older name of a flag, still accepted: a static FlagAlias registers it.
//   static const eps::cli::FlagAlias kOld("group-blocks", "eps-group-blocks");
class FlagAlias {
 public:
  FlagAlias(const char* old_name, const char* name);
};

// What a command line asked for besides flag values.
struct CommandLine {
  bool help = false;     // --help or -h
  bool version = false;  // --version
};

// Sets every registered abseil flag to its default, then parses `args` (argv without
// argv[0]) into them:
// --name=value; --name value (not for booleans, and not a value that starts with "--",
// which is taken for a forgotten value: "--step-log --metrics-listen=off" is an error);
// --name for a boolean; the last value of a repeated flag wins, except for
// std::vector<std::string> flags, whose values accumulate. Every argument is parsed even
// after --help or --version, so a bad one is still reported. Errors name the flag and the
// value as typed: "unknown flag --x", "--steps=abc: ...", "unexpected argument 'x'"; an
// integer too large for its type names the range the flag's help gives ("in [0, 2^30]").
absl::Status ParseArgs(const std::vector<std::string>& args, CommandLine* command_line);

// The whole command line of a main(): parses argv into the flags, runs `check` (the
// program's range checks, which read the flags), then prints the error, the usage
// (--help) or the version (--version). Returns the exit status to return at once (2 on
// a bad command line, else 0 after --help or --version), or -1 to go on.
int ParseMain(int argc, char** argv, absl::string_view program, absl::string_view synopsis,
              const std::function<absl::Status()>& check);

// Prints "<program>: <error> (<program> --help lists the flags)" and returns 2.
int BadFlag(absl::string_view program, const absl::Status& error);

// "usage: <synopsis>" and then every registered flag, sorted: its name, default and help.
std::string Usage(absl::string_view synopsis);

// The names of every registered flag (without "--"), plus "help" and "version".
std::vector<std::string> FlagNames();

// The flag's command-line name: its C++ name with '-' for '_' (FLAGS_lease_ms: --lease-ms).
// ParseArgs accepts either spelling.
std::string DisplayName(const absl::CommandLineFlag& flag);

// "<program> <project version>", what --version prints.
std::string VersionLine(absl::string_view program);

// True for host:port as the binaries listen on or dial it: a host name, an IPv4 address
// or a bracketed IPv6 address ("[::1]"), a colon, and a port of digits only in [0, 65535]
// (0: any). "localhost", "h:", "h:99999", "h:abc" and gRPC URIs ("unix:p", "dns:h") are not.
bool IsHostPort(absl::string_view address);

// A --target flag's value as the clients dial epsd (docs/cli.md): unix:///path, or host:port
// with a port in [1, 65535]. Anything else would reach gRPC's resolver and fail only when
// the calls do ("localhost" dials port 443, "h:99999" fails DNS); unix:path and
// unix-abstract: are refused as epsd's --listen refuses them, and so is a path too long
// for a socket address (CheckSocketPathLength). InvalidArgument naming the flag otherwise.
absl::Status CheckDialTarget(const absl::Flag<std::string>& flag);

// The longest Unix socket path, in bytes, that a socket address holds (sun_path less its
// terminating NUL: 107 on Linux).
size_t MaxSocketPathBytes();

// OK when `path` (after unix://) fits a socket address; else InvalidArgument naming the
// flag, the limit and the path's length. One check for epsd's --listen and the --targets.
absl::Status CheckSocketPathLength(const absl::CommandLineFlag& flag, absl::string_view path);

// "--name=<value>": the value as ParseArgs was given it, else the flag's current value.
// How errors name a flag.
std::string AsTyped(const absl::CommandLineFlag& flag);

// "--name=<value>: want <want>" (the value as AsTyped gives it), for a value that parsed
// but is out of range.
absl::Status Invalid(const absl::CommandLineFlag& flag, absl::string_view want);

template <typename T>
absl::Status Invalid(const absl::Flag<T>& flag, absl::string_view want) {
  return Invalid(absl::GetFlagReflectionHandle(flag), want);
}

// The flag's value when it lies in [lo, hi]; otherwise an error naming flag and value.
template <typename T, typename U>
absl::Status ReadInRange(const absl::Flag<T>& flag, U lo, U hi, U* out) {
  const T value = absl::GetFlag(flag);
  if (!(value >= lo && value <= hi)) {
    return Invalid(flag, absl::StrCat("a value in [", lo, ", ", hi, "]"));
  }
  *out = static_cast<U>(value);
  return absl::OkStatus();
}

// A Size flag in [lo, hi].
template <typename U>
absl::Status ReadInRange(const absl::Flag<Size>& flag, U lo, U hi, U* out) {
  const int64_t value = absl::GetFlag(flag).value;
  if (value < static_cast<int64_t>(lo) || value > static_cast<int64_t>(hi)) {
    return Invalid(
        flag, absl::StrCat("a size in [", AbslUnparseFlag(Size{static_cast<int64_t>(lo)}), ", ",
                           AbslUnparseFlag(Size{static_cast<int64_t>(hi)}),
                           "] (k, M, G, T are powers of 1024)"));
  }
  *out = static_cast<U>(value);
  return absl::OkStatus();
}

// A duration flag in [lo, hi].
absl::Status ReadInRange(const absl::CommandLineFlag& flag, absl::Duration value, absl::Duration lo,
                         absl::Duration hi, absl::Duration* out);
template <typename T>
absl::Status ReadDuration(const absl::Flag<T>& flag, absl::Duration lo, absl::Duration hi,
                          absl::Duration* out) {
  absl::Duration value;
  if constexpr (std::is_same_v<T, absl::Duration>) {
    value = absl::GetFlag(flag);
  } else {
    value = absl::GetFlag(flag).value;
  }
  return ReadInRange(absl::GetFlagReflectionHandle(flag), value, lo, hi, out);
}

}  // namespace eps::cli
