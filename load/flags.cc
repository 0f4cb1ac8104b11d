// Every flag eps-load accepts (docs/benchmarks/latency.md explains them).
#include "load/flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, target, "unix:///tmp/epsd.sock",
          "epsd's address: unix:///path or host:port");
ABSL_FLAG(std::string, preset, "llama-3-8b",
          "model shape: llama-3-8b, qwen2.5-7b, llama-3-70b-tp2|tp4|tp8 (one rank of TP 2, 4, "
          "8), smollm2-135m");
ABSL_FLAG(int, layers, 0, "override the preset's layers (0: the preset's)");
ABSL_FLAG(int, q_heads, 0, "override the preset's query heads (0: the preset's)");
ABSL_FLAG(int, kv_heads, 0, "override the preset's KV heads (0: the preset's)");
ABSL_FLAG(int, head_dim, 0, "override the preset's head dimension (0: the preset's)");
ABSL_FLAG(int, block_size, 0, "override the preset's tokens per block (0: the preset's)");
ABSL_FLAG(int, eps_group_blocks, 0, "blocks per summary group g (0: the preset's, 8)");
ABSL_FLAG(int, eps_dim, 0, "sketch dimension m (0: the preset's, 8)");
ABSL_FLAG(bool, quest8, false,
          "records also hold the quest8 part, which questclt then reads (docs/summaries.md)");
ABSL_FLAG(bool, quest8_only, false,
          "records hold the quest8 part and not quest's 16-bit part: questclt's smallest record "
          "(docs/summaries.md); method=quest is then refused");
ABSL_FLAG(int, coarse_blocks, 0,
          "attach with a coarse level of N blocks per coarse group (a multiple of the group's "
          "blocks above it, at most 4096), writing coarse records from the same keys (0: none)");
ABSL_FLAG(double, coarse_candidates, 0,
          "SelectOptions.coarse_candidates sent at Attach, in [1, 1024] (0: epsd's "
          "--eps-coarse-candidates); needs --coarse-blocks");
ABSL_FLAG(double, feedback_share, 0,
          "selection feedback: 0 = no feedback buffer; F in (0, 1]: each session shares one, "
          "and before every SelectPages eps-load writes the log-sum-exps of the workload's keys "
          "into a share F of each row's groups within its context (every layer and query head; "
          "the rest NaN), as an engine's attention would. Not timed: that write (host copies, or "
          "device-to-device copies waited for with --backend=cuda) and a one-entry check after "
          "the call that epsd consumed it. Timed: epsd reading the buffer and setting the "
          "step's rows back to NaN, inside SelectPages");
ABSL_FLAG(eps::cli::Size, batch, {8}, "sequences per SelectPages call, in [1, 4k]");
ABSL_FLAG(eps::load::ContextDistribution, context, {},
          "tokens per sequence: N, Nk or uniform:LO-HI (drawn per call)");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(10), "the measured window");
ABSL_FLAG(absl::Duration, warmup, absl::Seconds(1), "the unrecorded lead-in");
ABSL_FLAG(eps::load::Arrivals, rate, {},
          "SelectPages/s over all sessions: 0 = closed loop, R = fixed gaps, poisson:R = "
          "Poisson arrivals");
ABSL_FLAG(int, sessions, 1, "engines, each with its own buffers, client and channel, in [1, 256]");
ABSL_FLAG(int, ranks, 0,
          "N tensor-parallel ranks in [1, 64], one session each (rank r on device r mod the "
          "devices), every step sent to all at once: closed loop, no Ping, per-rank latency and "
          "the spread between ranks (0: off)");
ABSL_FLAG(std::string, mode, "stream", "SelectPages transport: stream | unary");
ABSL_FLAG(std::string, reply, "sync",
          "sync | async: SelectPages replies after the selection (sync) or once it is queued on "
          "the GPU (async, --backend=cuda; the step's fence runs on a stream of eps-load's own)");
ABSL_FLAG(absl::Duration, deadline, absl::Seconds(10),
          "the client's per-call deadline (a miss is an error)");
ABSL_FLAG(absl::Duration, slo, absl::Milliseconds(2), "calls slower than this count as over_slo");
ABSL_FLAG(int, ping_every, 1, "one Ping per N SelectPages on each session (0: none)");
ABSL_FLAG(int, floor_calls, 1000,
          "before the run: rounds of empty calls to a minimal gRPC server (--floor-server) and to "
          "epsd's Ping, callback and sync clients interleaved, on --target's transport (the "
          "RPC floor and the ratios to it); 0: skip");
ABSL_FLAG(std::string, floor_server, "process",
          "where the floor's minimal server runs: process (a forked child, as epsd is one) | "
          "in-process (sharing gRPC's threads with the client)");
ABSL_FLAG(std::string, ping_api, "callback",
          "callback | sync: Ping like EpsClient's unary call, or through the sync stub");
ABSL_FLAG(std::string, backend, "cpu",
          "where the shared buffers live: cpu | cuda (device 0, CUDA IPC)");
ABSL_FLAG(std::vector<std::string>, channel_arg, {},
          "extra gRPC channel argument KEY=INT (repeatable, or comma-separated)");
ABSL_FLAG(std::string, json, "", "write the report as JSON to this file");
ABSL_FLAG(uint64_t, seed, 1, "synthetic data and Poisson gaps");
ABSL_FLAG(bool, soak, false, "print every error; sample epsd's RSS and fds");
ABSL_FLAG(absl::Duration, sample_every, absl::Seconds(60), "soak: epsd sampling period");
ABSL_FLAG(int, epsd_pid, 0, "epsd's pid (0: found from the target's socket)");

// The shape flags' names before they matched epsd's.
static const eps::cli::FlagAlias kGroupBlocks("group-blocks", "eps-group-blocks");
static const eps::cli::FlagAlias kSketchDim("sketch-dim", "eps-dim");
