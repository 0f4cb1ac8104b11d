// eps-demo: a demo engine that decodes a synthetic long-context workload step
// by step against epsd.
//
// It allocates the shared buffers through the client library, prefills EPS
// summaries with the core/ writer, then per step appends one token per
// sequence (summary update, seal when a group fills, block table growth),
// writes the queries, calls SelectPages, and measures the softmax attention
// mass of the visited blocks against dense attention.
//
// exit: 0 done; 1 an error (out of memory included); 2 bad usage; 130 / 143 stopped by
// SIGINT / SIGTERM (the step loop ends, the session is detached, the shared-memory
// buffers are removed).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/flags.h"
#include "client/cpp/buffer_plan.h"
#include "client/cpp/engine_buffers.h"
#include "client/cpp/eps_client.h"
#include "core/layout.h"
#include "core/phi.h"
#include "core/status.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"

ABSL_FLAG(std::string, target, "unix:///tmp/epsd.sock",
          "epsd's address: unix:///path or host:port");
ABSL_FLAG(int, steps, 16, "decode steps");
ABSL_FLAG(eps::cli::Size, batch, {2}, "sequences, in [1, 4k]");
ABSL_FLAG(eps::cli::Size, context, {16384}, "prefilled tokens per sequence (16k, 32k, ...)");
ABSL_FLAG(absl::Duration, deadline, absl::Milliseconds(20),
          "the client's per-call deadline; a miss falls back to dense attention");
ABSL_FLAG(std::string, mode, "unary", "SelectPages transport: unary | stream");
ABSL_FLAG(uint64_t, seed, 7, "synthetic keys");
ABSL_FLAG(eps::cli::Millis, pace_ms, {absl::ZeroDuration()},
          "sleep between steps, like a real decode cadence (a bare number is ms)");

namespace {

// The signal that asked the step loop to stop, or 0 (lock-free: set from a handler).
std::atomic<int> stop_signal{0};
extern "C" void RequestStop(int signal) { stop_signal.store(signal); }

// The same names, types and units as eps-load's flags (docs/cli.md).
struct Args {
  std::string target;
  int steps = 0;
  int batch = 0;
  int64_t context = 0;
  absl::Duration deadline;
  bool stream = false;
  uint64_t seed = 0;
  absl::Duration pace;  // sleep between steps, like a real decode cadence
};

eps::client::BufferShape ShapeFor(const Args& a, const eps::ModelLayout& model) {
  eps::client::BufferShape shape;
  const int64_t max_context = a.context + a.steps;
  shape.max_seqs = a.batch;
  shape.max_context = max_context;
  shape.max_batch = a.batch;
  shape.num_slots = a.batch * eps::GroupsFor(max_context, model);
  return shape;
}

// What the run will hold, against this machine's memory: the synthetic keys of every
// (row, layer, kv head) for context + steps tokens, and the shared buffers. A run that
// cannot fit is refused here rather than ending in std::bad_alloc.
absl::Status CheckMemory(const Args& a) {
  const eps::ModelLayout model = eps::testing::DemoModel();
  const int64_t tokens = a.context + a.steps;
  absl::StatusOr<eps::client::BufferPlan> plan =
      eps::client::BufferPlan::For(model, ShapeFor(a, model));
  if (!plan.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--batch=", a.batch, ", --context=", a.context,
                                                   ", --steps=", a.steps, ": ",
                                                   plan.status().message()));
  }
  const double keys = static_cast<double>(a.batch) * model.num_layers * model.num_kv_heads *
                      tokens * model.head_dim * sizeof(float);
  const double need = keys + static_cast<double>(plan->size);
  const double have = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  if (need > have) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--batch=%d with --context=%d and --steps=%d needs about %.0f bytes (%.1f GiB), more "
        "than this machine's %.1f GiB of memory",
        a.batch, a.context, a.steps, need, need / (1 << 30), have / (1 << 30)));
  }
  return absl::OkStatus();
}

absl::StatusOr<Args> ReadFlags() {
  Args a;
  a.target = absl::GetFlag(FLAGS_target);
  RETURN_IF_ERROR(eps::cli::CheckDialTarget(FLAGS_target));
  RETURN_IF_ERROR(eps::cli::ReadInRange(FLAGS_steps, 1, 10'000'000, &a.steps));
  RETURN_IF_ERROR(eps::cli::ReadInRange(FLAGS_batch, 1, 4096, &a.batch));
  RETURN_IF_ERROR(eps::cli::ReadInRange(FLAGS_context, int64_t{1}, int64_t{1} << 24, &a.context));
  RETURN_IF_ERROR(
      eps::cli::ReadDuration(FLAGS_deadline, absl::Microseconds(1), absl::Hours(1), &a.deadline));
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "unary" && mode != "stream") return eps::cli::Invalid(FLAGS_mode, "unary or stream");
  a.stream = mode == "stream";
  a.seed = absl::GetFlag(FLAGS_seed);
  RETURN_IF_ERROR(
      eps::cli::ReadDuration(FLAGS_pace_ms, absl::ZeroDuration(), absl::Hours(1), &a.pace));
  RETURN_IF_ERROR(CheckMemory(a));
  return a;
}

// The whole run; every buffer it allocates is released on the way out, a
// std::bad_alloc included (main catches it).
int Run(const Args& args) {
  eps::ModelLayout model = eps::testing::DemoModel();
  const int d = model.head_dim, ratio = model.gqa_ratio();
  const int64_t gt = model.group_tokens();
  const int64_t max_context = args.context + args.steps;
  auto buffers = eps::client::EngineBuffers::Create(model, ShapeFor(args, model), "demo");
  if (!buffers.ok()) {
    std::fprintf(stderr, "eps-demo: %s\n", buffers.status().ToString().c_str());
    return 1;
  }
  eps::client::EngineBuffers& buf = **buffers;
  auto phi = eps::PhiBank::Create(model.phi_seed, model.num_layers, model.num_kv_heads, d,
                                  model.sketch_dim);
  eps::SummaryWriter writer(model, *phi);

  // Synthetic keys for every (row, layer, kv head), long enough for all steps.
  std::vector<eps::testing::SyntheticHead> heads;
  std::mt19937_64 rng(args.seed);
  for (int row = 0; row < args.batch; ++row) {
    for (int layer = 0; layer < model.num_layers; ++layer) {
      for (int kvh = 0; kvh < model.num_kv_heads; ++kvh) {
        eps::testing::SyntheticConfig c;
        c.head_dim = d;
        c.tokens = max_context;
        c.num_queries = ratio;
        c.num_needles = 1 + static_cast<int>(rng() % 4);
        c.seed = rng();
        heads.push_back(eps::testing::MakeSyntheticHead(c));
      }
    }
  }
  auto head_of = [&](int row, int layer, int kvh) -> const eps::testing::SyntheticHead& {
    return heads[(row * model.num_layers + layer) * model.num_kv_heads + kvh];
  };
  // Tables: slots contiguous per row; physical blocks a shuffled pool.
  std::vector<int32_t> physical(args.batch * buf.max_blocks());
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), rng);
  for (int row = 0; row < args.batch; ++row) {
    auto groups = buf.GroupRow(row);
    for (int64_t p = 0; p < buf.max_groups(); ++p)
      groups[p] = static_cast<int32_t>(row * buf.max_groups() + p);
    auto blocks = buf.BlockRow(row);
    for (int64_t b = 0; b < buf.max_blocks(); ++b) blocks[b] = physical[row * buf.max_blocks() + b];
  }
  // Appends tokens [from, to) of every (row, layer, kv head) to their summaries.
  auto write_tokens = [&](int row, int64_t from, int64_t to) {
    for (int layer = 0; layer < model.num_layers; ++layer) {
      for (int kvh = 0; kvh < model.num_kv_heads; ++kvh) {
        const auto& keys = head_of(row, layer, kvh).keys;
        for (int64_t t = from; t < to;) {
          const int64_t group = t / gt, end = std::min(to, (group + 1) * gt);
          auto record = buf.Record(buf.GroupRow(row)[group], layer, kvh);
          if (t % gt == 0) (void)writer.Reset(record);  // sized by the layout
          (void)writer.Append(record, layer, kvh,
                              {keys.data() + t * d, eps::DType::kFloat32, end - t, d});
          if (end % gt == 0) {
            (void)writer.Seal(record, layer, kvh,
                              {keys.data() + group * gt * d, eps::DType::kFloat32, gt, d});
          }
          t = end;
        }
      }
    }
  };
  for (int row = 0; row < args.batch; ++row) write_tokens(row, 0, args.context);

  eps::v1::AttachRequest attach;
  attach.set_engine_id("eps-demo");
  auto* l = attach.mutable_layout();
  l->set_num_layers(model.num_layers);
  l->set_num_q_heads(model.num_q_heads);
  l->set_num_kv_heads(model.num_kv_heads);
  l->set_head_dim(d);
  l->set_summary_layout(eps::kSummaryLayoutRevision);  // core/layout.h
  l->set_block_size(model.block_size);
  l->set_group_blocks(model.group_blocks);
  l->set_sketch_dim(model.sketch_dim);
  l->set_phi_seed(model.phi_seed);
  l->mutable_features()->set_key_sum(true);
  l->mutable_features()->set_principal(true);
  l->mutable_features()->set_quest(true);
  *attach.mutable_buffers() = buf.Descriptors();
  attach.set_max_batch(args.batch);
  attach.set_num_kv_blocks(physical.size());
  eps::client::ClientOptions options;
  options.target = args.target;
  options.deadline = absl::ToChronoMicroseconds(args.deadline);
  options.use_stream = args.stream;
  eps::client::EpsClient client(options, attach);
  if (absl::Status s = client.Attach(); !s.ok()) {
    // Only UNAVAILABLE means no epsd answered; any other code is epsd's own answer.
    std::fprintf(stderr, "eps-demo: attach to %s failed: %s%s\n", args.target.c_str(),
                 s.ToString().c_str(), absl::IsUnavailable(s) ? " (is epsd running?)" : "");
  }

  std::printf("eps-demo: %d sequences, %lld prefilled tokens, %d steps, %s over %s\n", args.batch,
              static_cast<long long>(args.context), args.steps, args.stream ? "stream" : "unary",
              args.target.c_str());
  std::printf("%5s %9s %14s %9s %12s %12s %10s %9s\n", "step", "context", "pages vis/tot",
              "visited", "recall mean", "recall min", "rtt us", "fallback");
  std::normal_distribution<float> noise(0.0f, 0.05f);
  double recall_all = 0, rtt_all = 0;
  int recall_n = 0;
  int steps = 0;
  for (int step = 1; step <= args.steps && stop_signal.load() == 0; ++step) {
    ++steps;
    if (args.pace > absl::ZeroDuration()) absl::SleepFor(args.pace);
    const int64_t ctx = args.context + step;  // the new token is in the cache
    std::vector<eps::v1::BatchRow> rows;
    for (int row = 0; row < args.batch; ++row) {
      write_tokens(row, ctx - 1, ctx);
      for (int layer = 0; layer < model.num_layers; ++layer) {
        for (int h = 0; h < model.num_q_heads; ++h) {
          const auto& q = head_of(row, layer, h / ratio).queries;
          auto out = buf.Query(layer, row, h);
          for (int i = 0; i < d; ++i) out[i] = q[(h % ratio) * d + i] * (1.0f + noise(rng));
        }
      }
      eps::v1::BatchRow r;
      r.set_table_row(row);
      r.set_context_tokens(ctx);
      r.set_seq_id(100 + row);
      rows.push_back(r);
    }
    const eps::client::StepResult result = client.SelectPages(step, rows);
    double recall_sum = 0, recall_min = 1;
    int n = 0;
    int64_t visited = 0, total = 0;
    for (int row = 0; row < args.batch; ++row) {
      std::unordered_map<int32_t, int64_t> logical;
      const auto block_row = buf.BlockRow(row);
      const int64_t nb = eps::BlocksFor(ctx, model.block_size);
      for (int64_t b = 0; b < nb; ++b) logical[block_row[b]] = b;
      for (int layer = 0; layer < model.num_layers; ++layer) {
        const auto visit = buf.VisitBlocks(layer, row);
        total += nb;
        visited += result.fallback ? nb : static_cast<int64_t>(visit.size());
        for (int h = 0; h < model.num_q_heads; ++h) {
          const auto& keys = head_of(row, layer, h / ratio).keys;
          const auto q = buf.Query(layer, row, h);
          const auto mass = eps::testing::GroupAttentionMass(
              std::span<const float>(keys.data(), ctx * d), q, d, model.block_size);
          double recall = 0;
          if (result.fallback) {
            recall = 1.0;
          } else {
            for (int32_t block : visit) recall += mass[logical.at(block)];
          }
          recall_sum += recall;
          recall_min = std::min(recall_min, recall);
          ++n;
        }
      }
    }
    recall_all += recall_sum / n;
    ++recall_n;
    rtt_all += result.round_trip_us;
    std::printf(
        "%5d %9lld %6lld/%-7lld %8.1f%% %12.4f %12.4f %10.0f %9s\n", step,
        static_cast<long long>(ctx), static_cast<long long>(visited), static_cast<long long>(total),
        100.0 * visited / total, recall_sum / n, recall_min, result.round_trip_us,
        result.fallback ? std::string(absl::StatusCodeToString(result.status.code())).c_str()
                        : "-");
  }
  const eps::client::ClientCounters c = client.counters();
  std::printf(
      "summary: %llu steps, %llu selected, %llu fallbacks (deadline %llu, unavailable %llu, "
      "not attached %llu, error %llu), mean recall %.4f, mean rtt %.0f us\n",
      static_cast<unsigned long long>(c.steps), static_cast<unsigned long long>(c.selected),
      static_cast<unsigned long long>(c.fallbacks()),
      static_cast<unsigned long long>(c.fallback_deadline),
      static_cast<unsigned long long>(c.fallback_unavailable),
      static_cast<unsigned long long>(c.fallback_not_attached),
      static_cast<unsigned long long>(c.fallback_error), recall_n > 0 ? recall_all / recall_n : 0.0,
      steps > 0 ? rtt_all / steps : 0.0);
  (void)client.Detach();
  if (const int signal = stop_signal.load(); signal != 0) {
    std::fprintf(stderr, "eps-demo: stopped by signal %d after %d steps\n", signal, steps);
    return 128 + signal;
  }
  // Fail-open kept the demo going, but a run in which epsd chose no step's pages showed
  // nothing of it: say so and exit 3 (as eps-load does when its calls fail), so that a
  // script checking an installation does not read a dense run as a working one.
  if (c.steps > 0 && c.selected == 0) {
    std::fprintf(stderr, "eps-demo: no step was selected by epsd at %s (%llu fallbacks)\n",
                 args.target.c_str(), static_cast<unsigned long long>(c.fallbacks()));
    return 3;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<Args> read;
  const int done = eps::cli::ParseMain(argc, argv, "eps-demo", "eps-demo [flags]", [&] {
    read = ReadFlags();
    return read.status();
  });
  if (done >= 0) return done;
  // SIGINT / SIGTERM end the step loop; Run then detaches and its buffers' destructors
  // remove the shared-memory objects (a killed demo would leave them in /dev/shm).
  struct sigaction action {};
  action.sa_handler = RequestStop;
  action.sa_flags = SA_RESTART;  // the run polls the flag; no system call should fail for it
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  try {
    const int code = Run(*read);
    std::fflush(stdout);
    return code;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "eps-demo: out of memory (--batch=%d, --context=%lld, --steps=%d); the buffers "
                 "are released\n",
                 read->batch, static_cast<long long>(read->context), read->steps);
    return 1;
  }
}
