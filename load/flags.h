// eps-load's command-line flags, declared for load/load_config.cc, which reads them into
// a LoadConfig. Every eps-load flag is defined in load/flags.cc. Flags that epsd or
// eps-demo also have carry the same name, type and unit there (docs/cli.md).
#pragma once

#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/time/time.h"
#include "cli/flags.h"
#include "load/load_config.h"

ABSL_DECLARE_FLAG(std::string, target);
ABSL_DECLARE_FLAG(std::string, preset);
ABSL_DECLARE_FLAG(int, layers);
ABSL_DECLARE_FLAG(int, q_heads);
ABSL_DECLARE_FLAG(int, kv_heads);
ABSL_DECLARE_FLAG(int, head_dim);
ABSL_DECLARE_FLAG(int, block_size);
ABSL_DECLARE_FLAG(int, eps_group_blocks);
ABSL_DECLARE_FLAG(int, eps_dim);
ABSL_DECLARE_FLAG(bool, quest8);
ABSL_DECLARE_FLAG(bool, quest8_only);
ABSL_DECLARE_FLAG(int, coarse_blocks);
ABSL_DECLARE_FLAG(double, coarse_candidates);
ABSL_DECLARE_FLAG(double, feedback_share);
ABSL_DECLARE_FLAG(eps::cli::Size, batch);
ABSL_DECLARE_FLAG(eps::load::ContextDistribution, context);
ABSL_DECLARE_FLAG(absl::Duration, duration);
ABSL_DECLARE_FLAG(absl::Duration, warmup);
ABSL_DECLARE_FLAG(eps::load::Arrivals, rate);
ABSL_DECLARE_FLAG(int, sessions);
ABSL_DECLARE_FLAG(int, ranks);
ABSL_DECLARE_FLAG(std::string, mode);
ABSL_DECLARE_FLAG(std::string, reply);
ABSL_DECLARE_FLAG(absl::Duration, deadline);
ABSL_DECLARE_FLAG(absl::Duration, slo);
ABSL_DECLARE_FLAG(int, ping_every);
ABSL_DECLARE_FLAG(int, floor_calls);
ABSL_DECLARE_FLAG(std::string, floor_server);
ABSL_DECLARE_FLAG(std::string, ping_api);
ABSL_DECLARE_FLAG(std::string, backend);
ABSL_DECLARE_FLAG(std::vector<std::string>, channel_arg);
ABSL_DECLARE_FLAG(std::string, json);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(bool, soak);
ABSL_DECLARE_FLAG(absl::Duration, sample_every);
ABSL_DECLARE_FLAG(int, epsd_pid);
