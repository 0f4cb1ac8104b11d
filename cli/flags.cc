#include "cli/flags.h"

#include <sys/un.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>

#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace eps::cli {
namespace {

bool AllDigits(absl::string_view text) {
  return std::all_of(text.begin(), text.end(), [](char c) { return absl::ascii_isdigit(c); });
}

// The value each flag was given on the command line, as typed: errors found after parsing
// (range checks) name it, not abseil's unparsed form ("1e9", not "277h46m40s").
std::map<std::string, std::string>& TypedValues() {
  static auto* typed = new std::map<std::string, std::string>();
  return *typed;
}

// The flag "--name" names, and whether it takes a value after a space.
struct Resolved {
  absl::CommandLineFlag* flag = nullptr;
  bool is_bool = false;
};

// Older flag names (with '-'), to the names they stand for.
std::map<std::string, std::string>& Aliases() {
  static auto* aliases = new std::map<std::string, std::string>();
  return *aliases;
}

// The range an integer flag's help names ("..., in [0, 2^30]"), else its type's range.
std::string IntegerRange(const absl::CommandLineFlag& flag) {
  const std::string help = flag.Help();
  if (const size_t open = help.find("in ["); open != std::string::npos) {
    if (const size_t close = help.find(']', open); close != std::string::npos) {
      return help.substr(open + 3, close - open - 2);
    }
  }
  if (flag.IsOfType<int>()) {
    return absl::StrCat("[", std::numeric_limits<int>::min(), ", ", std::numeric_limits<int>::max(),
                        "]");
  }
  if (flag.IsOfType<uint32_t>()) {
    return absl::StrCat("[0, ", std::numeric_limits<uint32_t>::max(), "]");
  }
  if (flag.IsOfType<uint64_t>()) {
    return absl::StrCat("[0, ", std::numeric_limits<uint64_t>::max(), "]");
  }
  return absl::StrCat("[", std::numeric_limits<int64_t>::min(), ", ",
                      std::numeric_limits<int64_t>::max(), "]");
}

// What a value of the flag's type looks like, for an error message about `value`.
std::string TypeHint(const absl::CommandLineFlag& flag, absl::string_view value) {
  if (flag.IsOfType<bool>()) return "want true or false";
  if (flag.IsOfType<int>() || flag.IsOfType<int64_t>() || flag.IsOfType<uint32_t>() ||
      flag.IsOfType<uint64_t>()) {
    // An integer that does not fit the type is out of range, not malformed.
    absl::string_view digits = value;
    if (!absl::ConsumePrefix(&digits, "-")) absl::ConsumePrefix(&digits, "+");
    if (!digits.empty() && AllDigits(digits)) {
      return absl::StrCat("want an integer in ", IntegerRange(flag));
    }
    return "want an integer";
  }
  if (flag.IsOfType<double>() || flag.IsOfType<float>()) return "want a number";
  // abseil says nothing about why: most often a bare number, which needs a unit.
  if (flag.IsOfType<absl::Duration>()) return "want a duration with a unit, like 5s or 200ms";
  return "not a valid value";
}

Resolved Find(absl::string_view name) {
  if (const auto alias = Aliases().find(std::string(name)); alias != Aliases().end()) {
    name = alias->second;
  }
  Resolved r;
  r.flag = absl::FindCommandLineFlag(absl::StrReplaceAll(name, {{"-", "_"}}));
  if (r.flag != nullptr) r.is_bool = r.flag->IsOfType<bool>();
  return r;
}

}  // namespace

FlagAlias::FlagAlias(const char* old_name, const char* name) { Aliases()[old_name] = name; }

std::string DisplayName(const absl::CommandLineFlag& flag) {
  return absl::StrReplaceAll(flag.Name(), {{"_", "-"}});
}

bool AbslParseFlag(absl::string_view text, Size* out, std::string* error) {
  absl::string_view digits = absl::StripAsciiWhitespace(text);
  int64_t scale = 1;
  for (const auto& [suffix, factor] : {std::pair<absl::string_view, int64_t>{"k", int64_t{1} << 10},
                                       {"K", int64_t{1} << 10},
                                       {"M", int64_t{1} << 20},
                                       {"G", int64_t{1} << 30},
                                       {"T", int64_t{1} << 40}}) {
    if (absl::ConsumeSuffix(&digits, suffix)) {
      scale = factor;
      break;
    }
  }
  int64_t n = 0;
  if (digits.empty() || !absl::SimpleAtoi(digits, &n) || n < 0 ||
      n > std::numeric_limits<int64_t>::max() / scale) {
    *error = "want a non-negative integer with an optional k, M, G or T (powers of 1024)";
    return false;
  }
  out->value = n * scale;
  return true;
}

std::string AbslUnparseFlag(Size size) {
  for (const auto& [suffix, shift] :
       {std::pair<const char*, int>{"T", 40}, {"G", 30}, {"M", 20}, {"k", 10}}) {
    const int64_t unit = int64_t{1} << shift;
    if (size.value != 0 && size.value % unit == 0) return absl::StrCat(size.value / unit, suffix);
  }
  return absl::StrCat(size.value);
}

// A Millis flag: abseil's syntax ("2ms", "1.5s"), or a bare decimal number of milliseconds
// ("250", "1.5"); either way a whole number of milliseconds, since the programs read these
// flags in milliseconds and a finer value would be cut to it ("500us" was 0 ms).
bool AbslParseFlag(absl::string_view text, Millis* millis, std::string* error) {
  absl::Duration* out = &millis->value;
  constexpr char kWhole[] = "want a whole number of milliseconds";
  // Digits with an optional fraction only: SimpleAtod also takes "0x10", "1e9" and "inf".
  const size_t dot = text.find('.');
  const absl::string_view integral = text.substr(0, dot);
  const absl::string_view fraction =
      dot == absl::string_view::npos ? absl::string_view() : text.substr(dot + 1);
  if (!integral.empty() && AllDigits(integral) &&
      (dot == absl::string_view::npos || (!fraction.empty() && AllDigits(fraction)))) {
    double n = 0;
    if (!absl::SimpleAtod(text, &n) || !std::isfinite(n) ||
        n * absl::Milliseconds(1) == absl::InfiniteDuration()) {
      *error = "want a finite duration";
      return false;
    }
    if (n != std::floor(n)) {
      *error = kWhole;
      return false;
    }
    *out = n * absl::Milliseconds(1);
    return true;
  }
  if (!absl::ParseDuration(text, out) || *out < absl::ZeroDuration() ||
      *out == absl::InfiniteDuration()) {
    *error = "want a duration such as 2ms, 1.5s or a number of milliseconds";
    return false;
  }
  if (*out % absl::Milliseconds(1) != absl::ZeroDuration()) {
    *error = kWhole;
    return false;
  }
  return true;
}
std::string AbslUnparseFlag(Millis d) { return absl::FormatDuration(d.value); }

absl::Status ParseArgs(const std::vector<std::string>& args, CommandLine* command_line) {
  // Start from the defaults, so that a second parse (tests) sees none of the first.
  TypedValues().clear();
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    std::string error;
    if (!flag->ParseFrom(flag->DefaultValue(), &error)) {
      return absl::InternalError(absl::StrCat("--", DisplayName(*flag), ": default: ", error));
    }
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h") {
      command_line->help = true;
      continue;
    }
    if (arg == "--version") {
      command_line->version = true;
      continue;
    }
    if (!absl::StartsWith(arg, "--") || arg.size() == 2) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const Resolved resolved = Find(name);
    if (resolved.flag == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    std::string value;
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
    } else if (resolved.is_bool) {
      value = "true";
    } else if (i + 1 < args.size() && !absl::StartsWith(args[i + 1], "--")) {
      value = args[++i];
    } else {
      // "--step-log --metrics-listen=off" once made a step log named after the next flag
      // and dropped that flag; a value that starts with -- is written --name=--value.
      return absl::InvalidArgumentError(
          i + 1 < args.size()
              ? absl::StrCat("--", name, " needs a value, not the flag ", args[i + 1], " (write --",
                             name, "=VALUE for a value that starts with --)")
              : absl::StrCat("--", name, " needs a value"));
    }
    // A list flag gathers the values of every occurrence.
    if (resolved.flag->IsOfType<std::vector<std::string>>() && !value.empty()) {
      const std::string current = resolved.flag->CurrentValue();
      const std::string defaults = resolved.flag->DefaultValue();
      if (!current.empty() && current != defaults) value = absl::StrCat(current, ",", value);
    }
    std::string error;
    if (!resolved.flag->ParseFrom(value, &error)) {
      // abseil says "Illegal value 'v' specified for flag 'f'; <why>": keep the why.
      const size_t why = error.find("; ");
      error = why == std::string::npos ? TypeHint(*resolved.flag, value) : error.substr(why + 2);
      return absl::InvalidArgumentError(absl::StrCat("--", name, "=", value, ": ", error));
    }
    TypedValues()[std::string(resolved.flag->Name())] = value;
  }
  return absl::OkStatus();
}

std::vector<std::string> FlagNames() {
  std::vector<std::string> names = {"help", "version"};
  for (const auto& [name, flag] : absl::GetAllFlags()) names.push_back(DisplayName(*flag));
  std::sort(names.begin(), names.end());
  return names;
}

std::string Usage(absl::string_view synopsis) {
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) flags.push_back(flag);
  std::sort(flags.begin(), flags.end(),
            [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  std::string out = absl::StrCat("usage: ", synopsis, "\n");
  for (const absl::CommandLineFlag* flag : flags) {
    const std::string value = flag->DefaultValue();
    absl::StrAppend(&out, "  --", DisplayName(*flag), "=", value.empty() ? "\"\"" : value, "\n");
    for (absl::string_view line : absl::StrSplit(flag->Help(), '\n')) {
      absl::StrAppend(&out, "      ", line, "\n");
    }
  }
  for (const auto& [old_name, name] : Aliases()) {
    absl::StrAppend(&out, "  --", old_name, "  (the older name of --", name, ")\n");
  }
  absl::StrAppend(
      &out,
      "  --help      this text\n"
      "  --version   print the version and exit\n"
      "Sizes take k, M, G, T (powers of 1024); durations a unit (500us, 2ms, 1.5s), and\n"
      "flags named *-ms also a bare number of milliseconds: a whole number of them either way.\n"
      "A value that starts with -- is written --name=VALUE.\n");
  return out;
}

int ParseMain(int argc, char** argv, absl::string_view program, absl::string_view synopsis,
              const std::function<absl::Status()>& check) {
  CommandLine command_line;
  if (absl::Status s = ParseArgs(std::vector<std::string>(argv + 1, argv + argc), &command_line);
      !s.ok()) {
    return BadFlag(program, s);
  }
  if (absl::Status s = check(); !s.ok()) return BadFlag(program, s);
  if (command_line.help) {
    std::fputs(Usage(synopsis).c_str(), stdout);
    return 0;
  }
  if (command_line.version) {
    std::printf("%s\n", VersionLine(program).c_str());
    return 0;
  }
  return -1;
}

int BadFlag(absl::string_view program, const absl::Status& error) {
  std::fprintf(stderr, "%s: %s (%s --help lists the flags)\n", std::string(program).c_str(),
               std::string(error.message()).c_str(), std::string(program).c_str());
  return 2;
}

std::string VersionLine(absl::string_view program) {
  return absl::StrCat(program, " ", EPS_VERSION);
}

absl::Status CheckDialTarget(const absl::Flag<std::string>& flag) {
  const std::string target = absl::GetFlag(flag);
  if (absl::StartsWith(target, "unix://")) {
    // unix://relative would name an authority, not a path: gRPC refuses it only at a call.
    if (!absl::StartsWith(target, "unix:///") || target.size() <= 8) {
      return Invalid(flag, "unix:///path: an absolute path after unix://");
    }
    // A longer path fails only at the first call (and gRPC's error does not say why).
    return CheckSocketPathLength(absl::GetFlagReflectionHandle(flag),
                                 absl::string_view(target).substr(7));
  }
  int port = 0;
  if (!IsHostPort(target) || !absl::SimpleAtoi(target.substr(target.rfind(':') + 1), &port) ||
      port == 0) {
    return Invalid(flag,
                   "unix:///path or host:port with a port in [1, 65535] (unix:path and "
                   "unix-abstract: are not supported)");
  }
  return absl::OkStatus();
}

size_t MaxSocketPathBytes() { return sizeof(sockaddr_un::sun_path) - 1; }

absl::Status CheckSocketPathLength(const absl::CommandLineFlag& flag, absl::string_view path) {
  if (path.size() <= MaxSocketPathBytes()) return absl::OkStatus();
  return Invalid(flag, absl::StrCat("a socket path of at most ", MaxSocketPathBytes(),
                                    " bytes (this one has ", path.size(), ")"));
}

bool IsHostPort(absl::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == absl::string_view::npos) return false;
  absl::string_view host = address.substr(0, colon);
  const absl::string_view port = address.substr(colon + 1);
  int number = -1;
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return absl::ascii_isdigit(c); }) ||
      !absl::SimpleAtoi(port, &number) || number > 65535) {
    return false;
  }
  if (absl::ConsumePrefix(&host, "[")) {
    // An IPv6 literal: hex digits, colons, dots (an embedded IPv4 address).
    if (!absl::ConsumeSuffix(&host, "]") || host.empty()) return false;
    return std::all_of(host.begin(), host.end(),
                       [](char c) { return absl::ascii_isxdigit(c) || c == ':' || c == '.'; });
  }
  // A host name or IPv4 address; gRPC would read "unix:x" or "dns:x" as a URI, so the
  // names of its schemes are not host names here.
  for (absl::string_view scheme : {"unix", "unix-abstract", "vsock", "dns", "ipv4", "ipv6"}) {
    if (host == scheme) return false;
  }
  return !host.empty() && std::all_of(host.begin(), host.end(), [](char c) {
    return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == '_';
  });
}

std::string AsTyped(const absl::CommandLineFlag& flag) {
  const auto typed = TypedValues().find(std::string(flag.Name()));
  return absl::StrCat("--", DisplayName(flag), "=",
                      typed != TypedValues().end() ? typed->second : flag.CurrentValue());
}

absl::Status Invalid(const absl::CommandLineFlag& flag, absl::string_view want) {
  return absl::InvalidArgumentError(absl::StrCat(AsTyped(flag), ": want ", want));
}

absl::Status ReadInRange(const absl::CommandLineFlag& flag, absl::Duration value, absl::Duration lo,
                         absl::Duration hi, absl::Duration* out) {
  if (value < lo || value > hi) {
    return Invalid(flag, absl::StrCat("a duration in [", absl::FormatDuration(lo), ", ",
                                      absl::FormatDuration(hi), "]"));
  }
  *out = value;
  return absl::OkStatus();
}

}  // namespace eps::cli
