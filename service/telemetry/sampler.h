// The OTEL_TRACES_SAMPLER samplers: always_on, always_off, traceidratio and
// their parentbased_ forms (the spec's default is parentbased_always_on).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "service/telemetry/trace_context.h"

namespace eps::telemetry {

class Sampler {
 public:
  enum class Root { kAlwaysOn, kAlwaysOff, kRatio };
  // `name` and `arg` as in OTEL_TRACES_SAMPLER / _ARG (arg: the ratio, default 1.0).
  static absl::StatusOr<Sampler> FromNames(const std::string& name, const std::string& arg);

  // Whether to record and export a new span with this trace id under `parent`.
  bool ShouldSample(const std::optional<TraceContext>& parent, const TraceId& trace_id) const;
  std::string Describe() const;

 private:
  bool parent_based_ = true;
  Root root_ = Root::kAlwaysOn;
  double ratio_ = 1.0;
  // kRatio: a trace is kept when its id's low 64 bits, as an integer, are below this bound;
  // ratio 1.0 keeps every id, the largest included (its bound does not fit in 64 bits).
  bool keep_all_ = true;
  uint64_t bound_ = 0;
};

}  // namespace eps::telemetry
