#include "load/load_config.h"

#include <cmath>
#include <functional>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace eps::load {
namespace {

ModelLayout Shape(int layers, int q_heads, int kv_heads, int head_dim) {
  ModelLayout m;
  m.num_layers = layers;
  m.num_q_heads = q_heads;
  m.num_kv_heads = kv_heads;
  m.head_dim = head_dim;
  m.block_size = 16;
  m.group_blocks = 8;
  m.sketch_dim = 8;
  m.phi_seed = 42;
  // Minimal records (Gram + norms), the default policy's needs (jl, not strict).
  m.features = {.key_sum = false, .principal = false, .quest = false};
  return m;
}

const std::map<std::string, ModelLayout>& Presets() {
  static const auto* presets = new std::map<std::string, ModelLayout>{
      {"llama-3-8b", Shape(32, 32, 8, 128)},
      {"qwen2.5-7b", Shape(28, 28, 4, 128)},
      // Llama-3-70B is 80 layers, 64 query heads, 8 KV heads; one rank of TP 8 holds 1/8.
      {"llama-3-70b-tp8", Shape(80, 8, 1, 128)},
      {"smollm2-135m", Shape(30, 9, 3, 64)},
  };
  return *presets;
}

absl::Status Bad(const std::string& flag, const std::string& value, const std::string& want) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": want ", want));
}

absl::StatusOr<int64_t> ParseTokens(const std::string& text) {
  absl::string_view v = text;
  int64_t scale = 1;
  if (absl::ConsumeSuffix(&v, "k") || absl::ConsumeSuffix(&v, "K")) scale = 1024;
  int64_t n = 0;
  if (!absl::SimpleAtoi(v, &n) || n < 1 || n > (int64_t{1} << 24) / scale) {
    return absl::InvalidArgumentError(text);
  }
  return n * scale;
}

template <typename T>
absl::Status SetInt(const std::string& flag, const std::string& v, T lo, T hi, T* out) {
  T parsed{};
  if (!absl::SimpleAtoi(v, &parsed) || parsed < lo || parsed > hi) {
    return Bad(flag, v, absl::StrCat("an integer in [", lo, ", ", hi, "]"));
  }
  *out = parsed;
  return absl::OkStatus();
}

}  // namespace

const std::vector<std::string>& PresetNames() {
  static const auto* names = [] {
    auto* v = new std::vector<std::string>();
    for (const auto& [name, model] : Presets()) v->push_back(name);
    return v;
  }();
  return *names;
}

absl::StatusOr<ModelLayout> PresetModel(const std::string& name) {
  const auto it = Presets().find(name);
  if (it == Presets().end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--preset=", name, ": want one of ", absl::StrJoin(PresetNames(), ", ")));
  }
  return it->second;
}

std::string ContextDistribution::ToString() const {
  return lo == hi ? absl::StrCat(lo) : absl::StrCat("uniform:", lo, "-", hi);
}

std::string Arrivals::ToString() const {
  if (closed_loop()) return "closed";
  return poisson ? absl::StrCat("poisson:", rate) : absl::StrCat(rate);
}

absl::StatusOr<std::chrono::microseconds> ParseDuration(const std::string& text) {
  absl::string_view v = text;
  double scale = 1e6;  // seconds by default
  if (absl::ConsumeSuffix(&v, "us")) {
    scale = 1;
  } else if (absl::ConsumeSuffix(&v, "ms")) {
    scale = 1e3;
  } else if (absl::ConsumeSuffix(&v, "s")) {
    scale = 1e6;
  } else if (absl::ConsumeSuffix(&v, "m")) {
    scale = 60e6;
  } else if (absl::ConsumeSuffix(&v, "h")) {
    scale = 3600e6;
  }
  double n = 0;
  if (v.empty() || !absl::SimpleAtod(v, &n) || !std::isfinite(n) || n < 0 || n * scale > 1e12) {
    return absl::InvalidArgumentError(
        absl::StrCat("duration '", text, "': want a number with us, ms, s, m or h"));
  }
  return std::chrono::microseconds(static_cast<int64_t>(std::llround(n * scale)));
}

absl::StatusOr<ContextDistribution> ParseContext(const std::string& text) {
  ContextDistribution d;
  absl::string_view v = text;
  if (absl::ConsumePrefix(&v, "uniform:")) {
    const std::vector<std::string> parts = absl::StrSplit(v, '-');
    if (parts.size() != 2) return Bad("context", text, "uniform:LO-HI");
    auto lo = ParseTokens(parts[0]);
    auto hi = ParseTokens(parts[1]);
    if (!lo.ok() || !hi.ok() || *lo > *hi) {
      return Bad("context", text, "uniform:LO-HI with 1 <= LO <= HI tokens");
    }
    d.lo = *lo;
    d.hi = *hi;
    return d;
  }
  auto n = ParseTokens(text);
  if (!n.ok()) return Bad("context", text, "tokens (e.g. 32768 or 32k) or uniform:LO-HI");
  d.lo = d.hi = *n;
  return d;
}

absl::StatusOr<Arrivals> ParseRate(const std::string& text) {
  Arrivals a;
  absl::string_view v = text;
  a.poisson = absl::ConsumePrefix(&v, "poisson:");
  if (!absl::SimpleAtod(v, &a.rate) || !std::isfinite(a.rate) || a.rate < 0 || a.rate > 1e6) {
    return Bad("rate", text, "calls/s in [0, 1e6] (0 = closed loop) or poisson:R");
  }
  if (a.poisson && a.rate <= 0) return Bad("rate", text, "poisson:R with R > 0");
  return a;
}

std::string Usage() {
  return absl::StrCat(
      "usage: eps-load [flags]\n"
      "  --target=unix:///tmp/epsd.sock   epsd's address (unix:///path or host:port)\n"
      "  --preset=llama-3-8b              model shape: ",
      absl::StrJoin(PresetNames(), ", "),
      "\n"
      "  --layers= --q-heads= --kv-heads= --head-dim= --block-size= --group-blocks= --sketch-dim=\n"
      "                                   override the preset's shape\n"
      "  --batch=8                        sequences per SelectPages call\n"
      "  --context=32768                  tokens per sequence: N, Nk or uniform:LO-HI (per call)\n"
      "  --duration=10s --warmup=1s       measured window, and the unrecorded lead-in\n"
      "  --rate=0                         SelectPages/s over all sessions: 0 = closed loop,\n"
      "                                   R = fixed gaps, poisson:R = Poisson arrivals\n"
      "  --sessions=1                     engines, each with its own buffers, client and channel\n"
      "  --mode=stream|unary              SelectPages transport (default stream)\n"
      "  --deadline=10s                   the client's per-call deadline (a miss is an error)\n"
      "  --slo=2ms                        calls slower than this are counted as over_slo\n"
      "  --ping-every=1                   one Ping per N SelectPages on each session (0 = none)\n"
      "  --ping-api=callback|sync         Ping like EpsClient's unary call, or via the sync stub\n"
      "  --backend=cpu|cuda               where the shared buffers live (cuda: device 0, CUDA IPC)\n"
      "  --channel-arg=KEY=INT            extra gRPC channel argument (repeatable)\n"
      "  --json=PATH                      write the report as JSON\n"
      "  --seed=1                         synthetic data and Poisson gaps\n"
      "  --soak                           print every error; sample epsd's RSS and fds\n"
      "  --sample-every=60s               soak: epsd sampling period\n"
      "  --epsd-pid=PID                   epsd's pid (default: found from the target's socket)\n");
}

absl::StatusOr<LoadConfig> ParseFlags(const std::vector<std::string>& args) {
  LoadConfig c;
  std::map<std::string, std::string> shape;  // custom shape flags, applied after the preset
  for (const std::string& arg : args) {
    if (!absl::StartsWith(arg, "--")) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    const size_t eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const bool has_value = eq != std::string::npos;
    const std::string v = has_value ? arg.substr(eq + 1) : "";
    auto need_value = [&]() -> absl::Status {
      if (!has_value) return absl::InvalidArgumentError(absl::StrCat("--", name, " needs =VALUE"));
      return absl::OkStatus();
    };
    auto duration = [&](std::chrono::microseconds* out, bool positive) -> absl::Status {
      if (absl::Status s = need_value(); !s.ok()) return s;
      auto d = ParseDuration(v);
      if (!d.ok())
        return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", d.status().message()));
      if (positive && d->count() <= 0) return Bad(name, v, "a duration > 0");
      *out = *d;
      return absl::OkStatus();
    };
    absl::Status s;
    if (name == "help") {
      c.help = true;
    } else if (name == "soak") {
      c.soak = v.empty() || v == "true" || v == "1";
      if (!c.soak && v != "false" && v != "0") s = Bad(name, v, "true or false");
    } else if (!(s = need_value()).ok()) {
      return s;
    } else if (name == "target") {
      if (v.empty()) return Bad(name, v, "unix:///path or host:port");
      c.target = v;
    } else if (name == "preset") {
      c.preset = v;
    } else if (name == "layers" || name == "q-heads" || name == "kv-heads" || name == "head-dim" ||
               name == "block-size" || name == "group-blocks" || name == "sketch-dim") {
      shape[name] = v;
    } else if (name == "batch") {
      s = SetInt(name, v, 1, 4096, &c.batch);
    } else if (name == "context") {
      auto d = ParseContext(v);
      if (!d.ok()) return d.status();
      c.context = *d;
    } else if (name == "duration") {
      s = duration(&c.duration, true);
    } else if (name == "warmup") {
      s = duration(&c.warmup, false);
    } else if (name == "rate") {
      auto a = ParseRate(v);
      if (!a.ok()) return a.status();
      c.arrivals = *a;
    } else if (name == "sessions") {
      s = SetInt(name, v, 1, 256, &c.sessions);
    } else if (name == "mode") {
      if (v != "unary" && v != "stream") return Bad(name, v, "unary or stream");
      c.stream = v == "stream";
    } else if (name == "deadline") {
      s = duration(&c.deadline, true);
    } else if (name == "slo") {
      s = duration(&c.slo, true);
    } else if (name == "ping-every") {
      s = SetInt(name, v, 0, 1000000, &c.ping_every);
    } else if (name == "ping-api") {
      if (v != "callback" && v != "sync") return Bad(name, v, "callback or sync");
      c.ping_sync = v == "sync";
    } else if (name == "backend") {
      if (v != "cpu" && v != "cuda") return Bad(name, v, "cpu or cuda");
      c.backend = v == "cuda" ? service::BackendKind::kCuda : service::BackendKind::kCpu;
    } else if (name == "channel-arg") {
      const size_t at = v.find('=');
      int value = 0;
      if (at == std::string::npos || at == 0 || !absl::SimpleAtoi(v.substr(at + 1), &value)) {
        return Bad(name, v, "KEY=INT, e.g. grpc.enable_retries=0");
      }
      c.channel_args.emplace_back(v.substr(0, at), value);
    } else if (name == "json") {
      if (v.empty()) return Bad(name, v, "a file path");
      c.json_path = v;
    } else if (name == "seed") {
      s = SetInt<uint64_t>(name, v, 0, UINT64_MAX, &c.seed);
    } else if (name == "sample-every") {
      s = duration(&c.sample_every, true);
    } else if (name == "epsd-pid") {
      s = SetInt(name, v, 1, INT32_MAX, &c.epsd_pid);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, "\n", Usage()));
    }
    if (!s.ok()) return s;
  }
  auto model = PresetModel(c.preset);
  if (!model.ok()) return model.status();
  c.model = *model;
  for (const auto& [name, v] : shape) {
    int* field = name == "layers"         ? &c.model.num_layers
                 : name == "q-heads"      ? &c.model.num_q_heads
                 : name == "kv-heads"     ? &c.model.num_kv_heads
                 : name == "head-dim"     ? &c.model.head_dim
                 : name == "block-size"   ? &c.model.block_size
                 : name == "group-blocks" ? &c.model.group_blocks
                                          : &c.model.sketch_dim;
    if (absl::Status s = SetInt(name, v, 1, 4096, field); !s.ok()) return s;
  }
  if (absl::Status s = c.model.Validate(); !s.ok()) return s;
  return c;
}

}  // namespace eps::load
