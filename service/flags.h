// epsd's command-line flags, declared for service/config.cc, which reads them into a
// ServerConfig. Every epsd flag is defined in service/flags.cc (one place: add a new
// flag there, declare it here, read and range-check it in config.cc).
#pragma once

#include <string>

#include "absl/flags/declare.h"
#include "cli/flags.h"

// Listeners.
ABSL_DECLARE_FLAG(std::string, listen);
ABSL_DECLARE_FLAG(bool, allow_remote);
ABSL_DECLARE_FLAG(std::string, socket_mode);
ABSL_DECLARE_FLAG(std::string, metrics_listen);
ABSL_DECLARE_FLAG(std::string, health_listen);
// Backends and the default selection policy of sessions.
ABSL_DECLARE_FLAG(std::string, backend);
ABSL_DECLARE_FLAG(std::string, eps_method);
ABSL_DECLARE_FLAG(int, eps_dim);
ABSL_DECLARE_FLAG(int, eps_group_blocks);
ABSL_DECLARE_FLAG(double, eps_alpha);
ABSL_DECLARE_FLAG(int, eps_first_n);
ABSL_DECLARE_FLAG(int, eps_last_n);
ABSL_DECLARE_FLAG(int, eps_top_pages);
ABSL_DECLARE_FLAG(std::string, eps_heads);
ABSL_DECLARE_FLAG(bool, eps_strict);
ABSL_DECLARE_FLAG(std::string, eps_budget);
ABSL_DECLARE_FLAG(double, eps_top_p);
ABSL_DECLARE_FLAG(double, eps_budget_mass);
ABSL_DECLARE_FLAG(double, eps_mass_temperature);
ABSL_DECLARE_FLAG(int, eps_min_pages);
ABSL_DECLARE_FLAG(int, eps_max_pages);
ABSL_DECLARE_FLAG(std::string, eps_mass_scope);
ABSL_DECLARE_FLAG(double, eps_coarse_candidates);
// Sessions, limits and lifetimes.
ABSL_DECLARE_FLAG(eps::cli::Millis, lease_ms);
ABSL_DECLARE_FLAG(int64_t, max_sessions);
ABSL_DECLARE_FLAG(int64_t, max_sessions_per_user);
ABSL_DECLARE_FLAG(eps::cli::Size, max_batch);
ABSL_DECLARE_FLAG(eps::cli::Size, max_message_bytes);
ABSL_DECLARE_FLAG(eps::cli::Size, max_session_bytes);
ABSL_DECLARE_FLAG(eps::cli::Size, max_server_bytes);
ABSL_DECLARE_FLAG(eps::cli::Size, max_session_mapped_bytes);
ABSL_DECLARE_FLAG(eps::cli::Size, max_server_mapped_bytes);
ABSL_DECLARE_FLAG(eps::cli::Millis, inputs_timeout_ms);
ABSL_DECLARE_FLAG(eps::cli::Millis, drain_ms);
// Telemetry.
ABSL_DECLARE_FLAG(std::string, step_log);
