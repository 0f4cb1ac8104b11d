#include "load/load_run.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <optional>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/layout.h"
#include "load/buffer_set.h"
#include "load/rpc_floor.h"
#include "load/workload.h"

namespace eps::load {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
double Micros(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// Sleeps until `t` in slices of 20 ms, so that SIGINT / SIGTERM end an open loop's wait
// at once (a gap lasts a second at --rate=1, and a Poisson gap has no bound); false when
// the stop came first.
bool WaitUntilUnlessStopped(Clock::time_point t, const std::atomic<bool>* stop) {
  for (;;) {
    if (stop != nullptr && stop->load()) return false;
    const Clock::time_point now = Clock::now();
    if (now >= t) return true;
    std::this_thread::sleep_until(std::min(t, now + std::chrono::milliseconds(20)));
  }
}

// A gap of the schedule, in seconds, on the clock: capped at 10^9 s (31 years), past the end
// of any run (--warmup and --duration are at most a day and a year), so that a tiny --rate
// cannot overflow the clock's 64-bit nanoseconds. At --rate=1e-12 the conversion once gave
// INT64_MIN, and the loop that counts the unsent calls of a session behind its schedule
// then stepped between two times for good, spinning and deaf to SIGINT and SIGTERM.
Clock::duration GapOf(double seconds) {
  constexpr double kMaxGapSeconds = 1e9;
  return std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(std::min(seconds, kMaxGapSeconds)));
}

std::string CodeName(absl::StatusCode code) { return absl::StatusCodeToString(code); }

std::string ReadLoadAvg() {
  std::ifstream in("/proc/loadavg");
  std::string line;
  std::getline(in, line);
  return line;
}

std::string UtcNow() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

// coarse_candidates: 0 leaves it to epsd's --eps-coarse-candidates.
v1::AttachRequest MakeAttach(const ModelLayout& model, float coarse_candidates,
                             const BufferSet& buffers, int batch, int64_t num_kv_blocks,
                             const std::string& engine_id) {
  v1::AttachRequest a;
  a.set_engine_id(engine_id);
  v1::ModelLayout* l = a.mutable_layout();
  l->set_num_layers(model.num_layers);
  l->set_num_q_heads(model.num_q_heads);
  l->set_num_kv_heads(model.num_kv_heads);
  l->set_head_dim(model.head_dim);
  l->set_summary_layout(eps::kSummaryLayoutRevision);  // core/layout.h
  l->set_block_size(model.block_size);
  l->set_group_blocks(model.group_blocks);
  l->set_coarse_blocks(model.coarse_blocks);
  l->set_sketch_dim(model.sketch_dim);
  l->set_phi_seed(model.phi_seed);
  l->mutable_features()->set_key_sum(model.features.key_sum);
  l->mutable_features()->set_principal(model.features.principal);
  l->mutable_features()->set_quest(model.features.quest);
  l->mutable_features()->set_quest8(model.features.quest8);
  *a.mutable_buffers() = buffers.Descriptors();
  a.set_max_batch(static_cast<uint32_t>(batch));
  a.set_num_kv_blocks(static_cast<uint64_t>(num_kv_blocks));
  a.set_backend(buffers.backend());
  a.set_device(buffers.device());
  a.set_device_uuid(buffers.device_uuid());  // the GPU whatever epsd's ordinals are
  if (coarse_candidates > 0) a.mutable_options()->set_coarse_candidates(coarse_candidates);
  return a;
}

// Shared between the sessions: the error log and epsd's samples.
class RunLog {
 public:
  RunLog(const LoadConfig& config, Clock::time_point t0, pid_t epsd_pid)
      : config_(config), t0_(t0), epsd_pid_(epsd_pid) {}

  void Sample(const std::string& why) {
    if (epsd_pid_ <= 0) return;
    auto stats = ReadProcessStats(epsd_pid_);
    std::lock_guard lock(mu_);
    if (!stats.ok()) {
      if (why != "error") notes_.push_back(absl::StrCat(why, ": ", stats.status().message()));
      return;
    }
    samples_.push_back({Seconds(Clock::now() - t0_), why, *stats});
  }

  void Error(int session, const char* call, const absl::Status& status) {
    const double t = Seconds(Clock::now() - t0_);
    bool sample = false;
    {
      std::lock_guard lock(mu_);
      if (errors_.size() < RunResult::kMaxErrorLog) {
        errors_.push_back(
            {t, session, call, CodeName(status.code()), std::string(status.message())});
      } else {
        ++dropped_;
      }
      // epsd's resources at an error, at most once a second.
      if (config_.soak && t - last_error_sample_ >= 1.0) {
        last_error_sample_ = t;
        sample = true;
      }
    }
    if (config_.soak) {
      std::fprintf(stderr, "eps-load: t=%.3fs session %d %s %s: %s\n", t, session, call,
                   CodeName(status.code()).c_str(), std::string(status.message()).c_str());
    }
    if (sample) Sample("error");
  }

  void MoveInto(RunResult& r) {
    std::lock_guard lock(mu_);
    r.epsd_samples = std::move(samples_);
    r.error_log = std::move(errors_);
    r.error_log_dropped = dropped_;
    for (const std::string& note : notes_) r.epsd_pid_note += "; " + note;
  }

 private:
  const LoadConfig& config_;
  const Clock::time_point t0_;
  const pid_t epsd_pid_;
  std::mutex mu_;
  std::vector<EpsdSample> samples_;
  std::vector<ErrorEvent> errors_;
  std::vector<std::string> notes_;
  uint64_t dropped_ = 0;
  double last_error_sample_ = -1e9;
};

// The ranks of a --ranks run: each rank arrives before every step, and the
// barrier's completion, run once per step, decides for all whether the run goes on.
struct Lockstep {
  struct Decide {
    Lockstep* self;
    void operator()() noexcept {
      self->released = Clock::now();
      self->go = self->released < self->end && (self->stop == nullptr || !self->stop->load());
    }
  };
  Lockstep(int ranks, Clock::time_point end_at, const std::atomic<bool>* stop_flag)
      : end(end_at), stop(stop_flag), barrier(ranks, Decide{this}) {}
  const Clock::time_point end;
  const std::atomic<bool>* const stop;
  // Written by the completion, read after the barrier releases: whether to go
  // on, and the step's release time, every rank's scheduled time (so all ranks
  // agree on which steps fall in the measured window).
  bool go = true;
  Clock::time_point released;
  std::barrier<Decide> barrier;
};

struct Session {
  std::unique_ptr<BufferSet> buffers;
  std::unique_ptr<client::EpsClient> client;
  CallResults select, ping;
  LatencySamples prepass_us, overhead_us;
  int64_t pages_visited = 0, pages_total = 0;
  std::vector<std::pair<uint64_t, double>> step_done_us;  // --ranks: (step, reply time since t0)
  // --feedback-share: the workload's feedback image (borrowed from RunLoad's) and the
  // counts of load_run.h's file comment.
  std::span<const float> feedback_image;
  LatencySamples feedback_write_us;
  int64_t feedback_probes = 0, feedback_written = 0, feedback_consumed = 0;
  // When its loop ended, before its Detach: the measured window ends with the last of them
  // (a Detach against a stalled epsd takes up to an attach deadline, no part of the run).
  Clock::time_point loop_end{};
};

// One step's feedback write, and the entry the step reads back to see it written, then
// consumed: row k mod batch, the last layer and q head, the first fed group within that
// row's context.
struct StepFeedback {
  bool wrote = false;
  double write_us = 0;
  bool armed = false;  // the write succeeded and a fed group lies within the context
  int layer = 0, q_head = 0;
  int64_t row = 0, group = 0;
  bool written = false;  // finite before the call
};

// Writes one step's feedback (--feedback-share) and arms its probe; errors are logged.
StepFeedback WriteStepFeedback(const ModelLayout& model, int index, uint64_t k,
                               std::span<const v1::BatchRow> rows, Session& s, RunLog& log) {
  std::vector<FeedbackRows> fed(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    fed[i] = {.row = rows[i].table_row(), .groups = GroupsFor(rows[i].context_tokens(), model)};
  }
  const Clock::time_point begin = Clock::now();
  if (absl::Status st = s.buffers->WriteFeedback(fed); !st.ok()) {
    log.Error(index, "WriteFeedback", st);
    return {};
  }
  StepFeedback probe{.wrote = true,
                     .write_us = Micros(Clock::now() - begin),
                     .layer = model.num_layers - 1,
                     .q_head = model.num_q_heads - 1};
  const FeedbackRows& r = fed[k % fed.size()];
  probe.row = r.row;
  const int64_t max_groups = s.buffers->max_groups();
  // The image is [layers, max_seqs, q_heads, max_groups], and max_seqs is the batch.
  const float* image =
      s.feedback_image.data() +
      ((static_cast<int64_t>(probe.layer) * rows.size() + r.row) * model.num_q_heads +
       probe.q_head) *
          max_groups;
  for (probe.group = 0; probe.group < r.groups; ++probe.group) {
    if (std::isfinite(image[probe.group])) break;
  }
  if (probe.group == r.groups) return probe;  // no fed group within this context
  absl::StatusOr<float> before =
      s.buffers->ReadFeedback(probe.layer, probe.row, probe.q_head, probe.group);
  if (!before.ok()) {
    log.Error(index, "ReadFeedback", before.status());
    return probe;
  }
  probe.armed = true;
  probe.written = std::isfinite(*before);
  return probe;
}

// The per-session loop; see the file comment of load_run.h for the schedule.
void RunSession(const LoadConfig& config, int index, Session& s, RunLog& log, Clock::time_point t0,
                Clock::time_point measure_begin, Clock::time_point end,
                const std::atomic<bool>* stop, Lockstep* lockstep) {
  std::mt19937_64 rng(config.seed * 1000003 + index);
  const bool closed = config.arrivals.closed_loop();
  const double per_session_rate = config.arrivals.rate / config.sessions;
  std::exponential_distribution<double> exp_gap(closed ? 1.0 : per_session_rate);
  auto next_gap = [&]() -> Clock::duration {
    if (closed) return Clock::duration::zero();
    return GapOf(config.arrivals.poisson ? exp_gap(rng) : 1.0 / per_session_rate);
  };
  // Fixed rate: sessions evenly staggered, so the sum is evenly spaced too.
  Clock::time_point next = t0;
  if (!closed) {
    next += config.arrivals.poisson ? next_gap() : GapOf(index / config.arrivals.rate);
  }
  std::vector<v1::BatchRow> rows(config.batch);
  for (int r = 0; r < config.batch; ++r) {
    rows[r].set_table_row(r);
    rows[r].set_seq_id(static_cast<uint64_t>(index) * 100000 + r);
  }
  // One call: waits for its scheduled time, then records it (when in the window). Its
  // latency runs from the scheduled time, or with `from_send` from the actual send.
  // Whether it succeeded; nothing when SIGINT / SIGTERM came during the wait (not sent).
  auto timed = [&](Clock::time_point scheduled, CallResults& out, const char* name, bool from_send,
                   auto&& call) -> std::optional<bool> {
    // A closed loop waits for nothing, but sends nothing once stopped either: its Ping
    // after a SelectPages was sent after SIGINT, and against an epsd that had stopped
    // answering held the exit for a second --deadline.
    if (closed ? stop != nullptr && stop->load() : !WaitUntilUnlessStopped(scheduled, stop)) {
      return std::nullopt;
    }
    const Clock::time_point sent = Clock::now();
    const absl::Status status = call();
    const Clock::time_point done = Clock::now();
    const bool measured = scheduled >= measure_begin;
    if (status.ok()) {
      if (measured) {
        out.latency.Record(Micros(done - (from_send ? sent : scheduled)));
        if (!closed) out.send_lag.Record(Micros(sent - scheduled));
      }
    } else {
      if (measured) ++out.errors_by_code[CodeName(status.code())];
      log.Error(index, name, status);
    }
    return status.ok();
  };
  uint64_t step = 0;
  const bool feedback = config.feedback_share > 0;
  for (uint64_t k = 0;; ++k) {
    for (auto& row : rows) row.set_context_tokens(config.context.Draw(rng));
    // The previous step's attention leaves its feedback before this step is released
    // or timed (load_run.h).
    StepFeedback step_feedback;
    if (feedback) step_feedback = WriteStepFeedback(config.model, index, k, rows, s, log);
    // Async: the engine's side of the fence stays outside the measured call. Signalled
    // before the step's time is taken: before a rank reaches the barrier (a step the
    // barrier then ends the run before is never sent), before a closed loop takes its
    // time (below), ahead of an open loop's schedule.
    auto signal_inputs_ready = [&] {
      if (absl::Status st = s.buffers->SignalInputsReady(step + 1); !st.ok()) {
        log.Error(index, "SignalInputsReady", st);
      }
    };
    if (lockstep != nullptr) {  // every rank stops together, or the barrier would wait forever
      if (config.reply_async) signal_inputs_ready();
      lockstep->barrier.arrive_and_wait();
      if (!lockstep->go) break;
    }
    Clock::time_point scheduled = lockstep != nullptr ? lockstep->released
                                  : closed            ? Clock::now()
                                                      : next;
    if (lockstep == nullptr && (scheduled >= end || (stop != nullptr && stop->load()))) break;
    if (!closed && Clock::now() >= end + kDrain) {
      // Hopelessly behind: count what is left of the schedule instead of sending it.
      for (Clock::time_point t = scheduled; t < end; t += next_gap()) {
        if (t >= measure_begin) ++s.select.unsent;
      }
      break;
    }
    client::StepResult result;
    if (config.reply_async && lockstep == nullptr) {
      signal_inputs_ready();
      if (closed) scheduled = Clock::now();  // the signal is not part of the call
    }
    const std::optional<bool> outcome =
        timed(scheduled, s.select, "SelectPages",
              /*from_send=*/false, [&] {
                result = s.client->SelectPages(++step, rows);
                return result.fallback ? result.status : absl::OkStatus();
              });
    if (!outcome.has_value()) break;  // stopped before its time came
    const bool ok = *outcome;
    if (config.reply_async) {
      if (absl::Status st = s.buffers->WaitSelection(step); !st.ok()) {
        log.Error(index, "WaitSelection", st);
      }
    }
    // An async reply carries the previous step's statistics (its own are not known yet).
    const v1::StepStats* stats = &result.response.stats();
    if (config.reply_async) {
      stats = result.response.earlier_size() > 0 ? &result.response.earlier(0) : nullptr;
    }
    if (ok && scheduled >= measure_begin) {
      if (stats != nullptr) {
        s.prepass_us.Record(stats->prepass_us());
        s.pages_visited += stats->pages_visited();
        s.pages_total += stats->pages_total();
      }
      // rtt - server: an async call's whole round trip is host work (the GPU runs after it).
      s.overhead_us.Record(result.round_trip_us -
                           (config.reply_async || stats == nullptr ? 0.0 : stats->prepass_us()));
      if (lockstep != nullptr) s.step_done_us.emplace_back(step, Micros(Clock::now() - t0));
      if (step_feedback.wrote) s.feedback_write_us.Record(step_feedback.write_us);
      if (const StepFeedback& probe = step_feedback; probe.armed) {
        absl::StatusOr<float> after =
            s.buffers->ReadFeedback(probe.layer, probe.row, probe.q_head, probe.group);
        if (after.ok()) {
          ++s.feedback_probes;
          s.feedback_written += probe.written;
          s.feedback_consumed += std::isnan(*after);
        } else {
          log.Error(index, "ReadFeedback", after.status());
        }
      }
    }
    const Clock::duration gap = next_gap();
    if (config.ping_every > 0 && k % config.ping_every == 0) {
      const Clock::time_point ping_at = closed ? Clock::now() : scheduled + gap / 2;
      if (ping_at < end) {
        // Ping is the floor: timed from its send, not from its slot in the schedule, which
        // a session behind on its SelectPages reaches late (that lag is send_lag).
        timed(ping_at, s.ping, "Ping", /*from_send=*/true, [&] {
          return config.ping_sync ? s.client->Ping(config.deadline)
                                  : CallbackPing(s.client->stub(), config.deadline);
        });
      }
    }
    // A closed loop against a dead target would spin: pause a little after a failure.
    if (closed && !ok) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    next = scheduled + gap;
  }
  // Each session detaches as it ends, all at once: one after another, after the run,
  // an epsd that no longer answered held the exit for an attach deadline (500 ms) per
  // session, over two minutes with --sessions=256.
  s.loop_end = Clock::now();
  (void)s.client->Detach();
}

}  // namespace

uint64_t CallResults::errors() const {
  uint64_t n = 0;
  for (const auto& [code, count] : errors_by_code) n += count;
  return n;
}

void CallResults::Merge(const CallResults& other) {
  latency.Merge(other.latency);
  send_lag.Merge(other.send_lag);
  unsent += other.unsent;
  for (const auto& [code, count] : other.errors_by_code) errors_by_code[code] += count;
}

absl::StatusOr<RunResult> RunLoad(const LoadConfig& config, const std::atomic<bool>* stop) {
  RunResult r;
  const auto prefill_start = Clock::now();
  const WorkloadImage image = BuildWorkload(config.model, config.batch, config.context.max(),
                                            config.seed, config.feedback_share);
  r.summary_bytes_per_session = static_cast<int64_t>(image.summary_pool.size() * sizeof(float));

  std::vector<Session> sessions(config.sessions);
  const int devices = config.backend == service::BackendKind::kCuda ? DeviceCount() : 0;
  for (int i = 0; i < config.sessions; ++i) {
    Session& s = sessions[i];
    // A rank's buffers on its own GPU where there are enough, else sharing them.
    const int device = config.ranks > 0 && devices > 0 ? i % devices : 0;
    if (config.ranks > 0) r.ranks.emplace_back().device = device;
    BufferSetShape shape = image.shape;
    shape.selection_wait = config.deadline;  // at most an hour, as a watchdog's timeout
    auto buffers = CreateBufferSet(config.backend, config.model, shape, device);
    if (!buffers.ok()) return buffers.status();
    s.buffers = std::move(*buffers);
    if (absl::Status st = image.WriteTo(*s.buffers); !st.ok()) return st;
    if (config.feedback_share > 0) {
      if (absl::Status st = s.buffers->SetFeedbackPattern(image.feedback); !st.ok()) return st;
      s.feedback_image = image.feedback;
    }
    client::ClientOptions options;
    options.target = config.target;
    options.deadline = config.deadline;
    options.use_stream = config.stream;
    options.reply_async = config.reply_async;
    if (config.reply_async) {
      // Fail open as an engine must: release the step densely on the same stream.
      BufferSet* set = s.buffers.get();
      options.on_fallback = [set](uint64_t step) { set->ReleaseDense(step).IgnoreError(); };
    }
    options.channel_args = config.channel_args;
    options.fail_open = true;
    s.client = std::make_unique<client::EpsClient>(
        options,
        MakeAttach(config.model, config.coarse_candidates, *s.buffers, config.batch,
                   image.num_kv_blocks,
                   absl::StrCat("eps-load-", getpid(), config.ranks > 0 ? "/rank" : "-", i)));
  }
  r.prefill_s = Seconds(Clock::now() - prefill_start);
  for (int i = 0; i < config.sessions; ++i) {
    if (absl::Status st = sessions[i].client->Attach(); !st.ok()) {
      std::fprintf(stderr,
                   "eps-load: session %d: attach to %s failed: %s (the run goes on and "
                   "counts every failed call)\n",
                   i, config.target.c_str(), st.ToString().c_str());
    }
  }

  if (config.epsd_pid > 0) {
    r.epsd_pid = config.epsd_pid;
    r.epsd_pid_note = "from --epsd-pid";
  } else if (auto pid = FindListeningProcess(config.target); pid.ok()) {
    r.epsd_pid = *pid;
    r.epsd_pid_note = "found listening on the target";
  } else {
    r.epsd_pid_note = std::string(pid.status().message());
  }

  r.started_utc = UtcNow();
  r.load_start = ReadLoadAvg();
  const Clock::time_point t0 = Clock::now() + std::chrono::milliseconds(10);
  const Clock::time_point measure_begin = t0 + config.warmup;
  const Clock::time_point end = measure_begin + config.duration;
  RunLog log(config, t0, r.epsd_pid);
  log.Sample("start");

  std::mutex sampler_mu;
  std::condition_variable sampler_cv;
  bool stop_sampler = false;
  std::thread sampler;
  if (config.soak && r.epsd_pid > 0) {
    sampler = std::thread([&] {
      std::unique_lock lock(sampler_mu);
      while (!sampler_cv.wait_for(lock, config.sample_every, [&] { return stop_sampler; })) {
        lock.unlock();
        log.Sample("periodic");
        lock.lock();
      }
    });
  }
  std::fprintf(stderr, "eps-load: %d session%s running on %s (SIGINT or SIGTERM stops early)\n",
               config.sessions, config.sessions == 1 ? "" : "s", config.target.c_str());
  std::unique_ptr<Lockstep> lockstep;
  if (config.ranks > 0) lockstep = std::make_unique<Lockstep>(config.sessions, end, stop);
  std::vector<std::thread> threads;
  for (int i = 0; i < config.sessions; ++i) {
    threads.emplace_back([&, i] {
      RunSession(config, i, sessions[i], log, t0, measure_begin, end, stop, lockstep.get());
    });
  }
  for (std::thread& t : threads) t.join();
  if (sampler.joinable()) {
    {
      std::lock_guard lock(sampler_mu);
      stop_sampler = true;
    }
    sampler_cv.notify_all();
    sampler.join();
  }
  log.Sample("end");
  r.load_end = ReadLoadAvg();
  r.stopped_early = stop != nullptr && stop->load();
  Clock::time_point loops_end = measure_begin;
  for (const Session& s : sessions) loops_end = std::max(loops_end, s.loop_end);
  r.measured_s = Seconds(std::clamp(std::min(loops_end, end), measure_begin, end) - measure_begin);

  if (config.ranks > 0) {
    // The spread of every step that all ranks measured (a failed call has no reply time).
    std::map<uint64_t, std::pair<int, std::pair<double, double>>> by_step;  // ranks, first, last
    for (int i = 0; i < config.sessions; ++i) {
      r.ranks[i].latency = sessions[i].select.latency;
      r.ranks[i].prepass_us = sessions[i].prepass_us;
      for (const auto& [step, done] : sessions[i].step_done_us) {
        auto [it, fresh] = by_step.try_emplace(step, 0, std::make_pair(done, done));
        auto& [count, range] = it->second;
        ++count;
        range.first = std::min(range.first, done);
        range.second = std::max(range.second, done);
      }
    }
    for (const auto& [step, entry] : by_step) {
      if (entry.first == config.sessions) {
        r.rank_spread_us.Record(entry.second.second - entry.second.first);
      }
    }
  }
  for (Session& s : sessions) {
    r.select.Merge(s.select);
    r.ping.Merge(s.ping);
    r.prepass_us.Merge(s.prepass_us);
    r.overhead_us.Merge(s.overhead_us);
    r.pages_visited += s.pages_visited;
    r.pages_total += s.pages_total;
    r.feedback_write_us.Merge(s.feedback_write_us);
    r.feedback_probes += s.feedback_probes;
    r.feedback_written += s.feedback_written;
    r.feedback_consumed += s.feedback_consumed;
    const client::ClientCounters c = s.client->counters();
    r.fallbacks.steps += c.steps;
    r.fallbacks.selected += c.selected;
    r.fallbacks.fallback_deadline += c.fallback_deadline;
    r.fallbacks.fallback_unavailable += c.fallback_unavailable;
    r.fallbacks.fallback_not_attached += c.fallback_not_attached;
    r.fallbacks.fallback_error += c.fallback_error;
    r.fallbacks.reattaches += c.reattaches;
    r.fallbacks.errors += c.errors;
  }
  log.MoveInto(r);
  return r;
}

}  // namespace eps::load
