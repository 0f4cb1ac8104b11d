#include "load/load_config.h"

#include <unistd.h>

#include <cmath>
#include <functional>
#include <map>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "cli/flags.h"
#include "core/status.h"
#include "load/buffer_set.h"
#include "load/flags.h"

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
  // Gram, norms and quest's 16-bit part: the default method (questclt) reads the quest part.
  m.features = {.key_sum = false, .principal = false, .quest = true};
  return m;
}

const std::map<std::string, ModelLayout>& Presets() {
  static const auto* presets = new std::map<std::string, ModelLayout>{
      {"llama-3-8b", Shape(32, 32, 8, 128)},
      {"qwen2.5-7b", Shape(28, 28, 4, 128)},
      // Llama-3-70B is 80 layers, 64 query heads, 8 KV heads; one rank of TP 8 holds 1/8.
      {"llama-3-70b-tp2", Shape(80, 32, 4, 128)},
      {"llama-3-70b-tp4", Shape(80, 16, 2, 128)},
      {"llama-3-70b-tp8", Shape(80, 8, 1, 128)},
      {"smollm2-135m", Shape(30, 9, 3, 64)},
  };
  return *presets;
}

absl::Status Bad(const std::string& flag, const std::string& value, const std::string& want) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": want ", want));
}

// A token count, with the sizes' k, M, G suffixes (cli::Size), in [1, 2^24].
absl::StatusOr<int64_t> ParseTokens(const std::string& text) {
  cli::Size n;
  std::string error;
  if (!cli::AbslParseFlag(text, &n, &error) || n.value < 1 || n.value > (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(text);
  }
  return n.value;
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

bool AbslParseFlag(absl::string_view text, ContextDistribution* out, std::string* error) {
  absl::StatusOr<ContextDistribution> d = ParseContext(std::string(text));
  if (!d.ok()) {
    // "--context=x: want ...": keep the want.
    const std::string message(d.status().message());
    const size_t want = message.find(": ");
    *error = want == std::string::npos ? message : message.substr(want + 2);
    return false;
  }
  *out = *d;
  return true;
}

std::string AbslUnparseFlag(const ContextDistribution& d) { return d.ToString(); }

bool AbslParseFlag(absl::string_view text, Arrivals* out, std::string* error) {
  absl::StatusOr<Arrivals> a = ParseRate(std::string(text));
  if (!a.ok()) {
    const std::string message(a.status().message());
    const size_t want = message.find(": ");
    *error = want == std::string::npos ? message : message.substr(want + 2);
    return false;
  }
  *out = *a;
  return true;
}

std::string AbslUnparseFlag(const Arrivals& a) { return a.closed_loop() ? "0" : a.ToString(); }

std::string Usage() { return cli::Usage("eps-load [flags]"); }

namespace {

std::chrono::microseconds Us(absl::Duration d) {
  return std::chrono::microseconds(absl::ToInt64Microseconds(d));
}

// A shape flag and the field of ModelLayout it sets.
struct ShapeFlag {
  const absl::Flag<int>* flag;
  int ModelLayout::*field;
};

// The shape flags over the preset: each nonzero value replaces its field (0 keeps the
// preset's; no preset has a coarse level). Core's own check (ModelLayout::Check) then
// judges the shape, so that its ranges and relations are eps-load's too; a refusal names
// the flags that set the fields of the broken rule (the preset when none did) and gives
// core's reason: "--head-dim=6: head_dim=6 is not a multiple of 4".
absl::Status ReadShape(const std::string& preset, ModelLayout* m) {
  const ShapeFlag flags[] = {
      {&FLAGS_layers, &ModelLayout::num_layers},
      {&FLAGS_q_heads, &ModelLayout::num_q_heads},
      {&FLAGS_kv_heads, &ModelLayout::num_kv_heads},
      {&FLAGS_head_dim, &ModelLayout::head_dim},
      {&FLAGS_block_size, &ModelLayout::block_size},
      {&FLAGS_eps_group_blocks, &ModelLayout::group_blocks},
      {&FLAGS_eps_dim, &ModelLayout::sketch_dim},
      {&FLAGS_coarse_blocks, &ModelLayout::coarse_blocks},
  };
  for (const auto& [flag, field] : flags) {
    if (const int value = absl::GetFlag(*flag); value != 0) m->*field = value;
  }
  const std::optional<LayoutRefusal> refusal = m->Check();
  if (!refusal) return absl::OkStatus();
  std::vector<std::string> named;
  for (int ModelLayout::*field : refusal->fields) {
    for (const auto& [flag, set] : flags) {
      if (set == field && absl::GetFlag(*flag) != 0) {
        named.push_back(cli::AsTyped(absl::GetFlagReflectionHandle(*flag)));
      }
    }
  }
  if (named.empty()) named.push_back(absl::StrCat("--preset=", preset));
  return absl::InvalidArgumentError(
      absl::StrCat(absl::StrJoin(named, ", "), ": ", refusal->reason.message()));
}

}  // namespace

// What the run will hold on the host, against this machine's memory: the workload's image
// (BuildWorkload: summaries, tables, queries, feedback, about the buffers' size), each
// session's shared buffers with --backend=cpu, and one synthetic key stream at a time.
// Flags within their ranges can ask for hundreds of GB (--context=16M at d = 1024, g = 1):
// refused here rather than ending in std::bad_alloc.
absl::Status CheckMemory(const LoadConfig& c) {
  const int64_t max_context = c.context.max();
  const ModelLayout& m = c.model;
  const BufferSetShape shape{.num_slots = int64_t{c.batch} * GroupsFor(max_context, m),
                             .max_seqs = c.batch,
                             .max_context = max_context,
                             .max_batch = c.batch,
                             .coarse_slots = int64_t{c.batch} * CoarseGroupsFor(max_context, m),
                             .with_feedback = c.feedback_share > 0};
  absl::StatusOr<client::BufferPlan> plan = client::BufferPlan::For(m, ClientShape(shape));
  if (!plan.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--batch=", c.batch, ", --context=", max_context,
                                                   ": ", plan.status().message()));
  }
  const int copies = 1 + (c.backend == service::BackendKind::kCpu ? c.sessions : 0);
  const double need = static_cast<double>(plan->size) * copies +
                      4.0 * static_cast<double>(max_context) * m.head_dim * sizeof(float);
  const double have = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  if (need > have) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--batch=%d with --context=%d (and the model's shape, %d session(s)) needs about %.0f "
        "bytes (%.1f GiB) of host memory, more than this machine's %.1f GiB",
        c.batch, max_context, c.sessions, need, need / (1 << 30), have / (1 << 30)));
  }
  return absl::OkStatus();
}

absl::StatusOr<LoadConfig> ParseFlags(const std::vector<std::string>& args) {
  cli::CommandLine command_line;
  RETURN_IF_ERROR(cli::ParseArgs(args, &command_line));
  LoadConfig c;
  c.help = command_line.help;
  c.version = command_line.version;
  c.target = absl::GetFlag(FLAGS_target);
  RETURN_IF_ERROR(cli::CheckDialTarget(FLAGS_target));
  c.preset = absl::GetFlag(FLAGS_preset);
  absl::StatusOr<ModelLayout> model = PresetModel(c.preset);
  if (!model.ok()) return model.status();
  c.model = *model;
  c.model.features.quest8 = absl::GetFlag(FLAGS_quest8) || absl::GetFlag(FLAGS_quest8_only);
  if (absl::GetFlag(FLAGS_quest8_only)) c.model.features.quest = false;
  RETURN_IF_ERROR(ReadShape(c.preset, &c.model));
  const double coarse_candidates = absl::GetFlag(FLAGS_coarse_candidates);
  if (coarse_candidates != 0 && !(coarse_candidates >= 1 && coarse_candidates <= 1024)) {
    return cli::Invalid(FLAGS_coarse_candidates, "0 (epsd's) or a number in [1, 1024]");
  }
  if (coarse_candidates != 0 && !c.model.has_coarse_level()) {
    return cli::Invalid(FLAGS_coarse_candidates, "0 without --coarse-blocks");
  }
  c.coarse_candidates = static_cast<float>(coarse_candidates);
  c.feedback_share = absl::GetFlag(FLAGS_feedback_share);
  if (!(c.feedback_share >= 0 && c.feedback_share <= 1)) {  // NaN fails too
    return cli::Invalid(FLAGS_feedback_share,
                        "0 (no feedback buffer) or the share of each row's groups fed, in (0, 1]");
  }
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_batch, 1, 4096, &c.batch));
  c.context = absl::GetFlag(FLAGS_context);
  absl::Duration d;
  RETURN_IF_ERROR(
      cli::ReadDuration(FLAGS_duration, absl::Microseconds(1), absl::Hours(24 * 365), &d));
  c.duration = Us(d);
  RETURN_IF_ERROR(cli::ReadDuration(FLAGS_warmup, absl::ZeroDuration(), absl::Hours(24), &d));
  c.warmup = Us(d);
  c.arrivals = absl::GetFlag(FLAGS_rate);
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_sessions, 1, 256, &c.sessions));
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "unary" && mode != "stream") return cli::Invalid(FLAGS_mode, "unary or stream");
  c.stream = mode == "stream";
  RETURN_IF_ERROR(cli::ReadDuration(FLAGS_deadline, absl::Microseconds(1), absl::Hours(1), &d));
  c.deadline = Us(d);
  RETURN_IF_ERROR(cli::ReadDuration(FLAGS_slo, absl::Microseconds(1), absl::Hours(1), &d));
  c.slo = Us(d);
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_ping_every, 0, 1000000, &c.ping_every));
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_floor_calls, 0, 10000000, &c.floor_calls));
  const std::string floor_server = absl::GetFlag(FLAGS_floor_server);
  if (floor_server != "process" && floor_server != "in-process") {
    return cli::Invalid(FLAGS_floor_server, "process or in-process");
  }
  c.floor_in_process = floor_server == "in-process";
  const std::string api = absl::GetFlag(FLAGS_ping_api);
  if (api != "callback" && api != "sync") return cli::Invalid(FLAGS_ping_api, "callback or sync");
  c.ping_sync = api == "sync";
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend != "cpu" && backend != "cuda") return cli::Invalid(FLAGS_backend, "cpu or cuda");
  c.backend = backend == "cuda" ? service::BackendKind::kCuda : service::BackendKind::kCpu;
  const std::string reply = absl::GetFlag(FLAGS_reply);
  if (reply != "sync" && reply != "async") return cli::Invalid(FLAGS_reply, "sync or async");
  c.reply_async = reply == "async";
  if (c.reply_async && c.backend != service::BackendKind::kCuda) {
    return cli::Invalid(FLAGS_reply, "sync: async replies need --backend=cuda (device buffers)");
  }
  for (const std::string& arg : absl::GetFlag(FLAGS_channel_arg)) {
    const size_t at = arg.find('=');
    int value = 0;
    if (at == std::string::npos || at == 0 || !absl::SimpleAtoi(arg.substr(at + 1), &value)) {
      return cli::Invalid(FLAGS_channel_arg, "KEY=INT, e.g. grpc.enable_retries=0");
    }
    c.channel_args.emplace_back(arg.substr(0, at), value);
  }
  c.json_path = absl::GetFlag(FLAGS_json);
  c.seed = absl::GetFlag(FLAGS_seed);
  c.soak = absl::GetFlag(FLAGS_soak);
  RETURN_IF_ERROR(
      cli::ReadDuration(FLAGS_sample_every, absl::Milliseconds(1), absl::Hours(24), &d));
  c.sample_every = Us(d);
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_epsd_pid, 0, INT32_MAX, &c.epsd_pid));
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_ranks, 0, 64, &c.ranks));
  if (c.ranks > 0) {
    if (c.sessions != 1) {
      return cli::Invalid(FLAGS_ranks, "no --sessions with it: --ranks runs one session per rank");
    }
    if (!c.arrivals.closed_loop()) {
      return cli::Invalid(FLAGS_rate, "0 with --ranks (the ranks step in lockstep)");
    }
    c.sessions = c.ranks;
    c.ping_every = 0;  // a Ping between two lockstep steps would delay one rank
  }
  if (!c.help && !c.version) RETURN_IF_ERROR(CheckMemory(c));
  return c;
}

}  // namespace eps::load
