#include "service/telemetry/sampler.h"

#include <cmath>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace eps::telemetry {

absl::StatusOr<Sampler> Sampler::FromNames(const std::string& name, const std::string& arg) {
  Sampler s;
  std::string root = name.empty() ? "parentbased_always_on" : name;
  if (root.rfind("parentbased_", 0) == 0) {
    s.parent_based_ = true;
    root = root.substr(12);
  } else {
    s.parent_based_ = false;
  }
  if (root == "always_on") {
    s.root_ = Root::kAlwaysOn;
  } else if (root == "always_off") {
    s.root_ = Root::kAlwaysOff;
  } else if (root == "traceidratio") {
    s.root_ = Root::kRatio;
    if (!arg.empty()) {
      double ratio = 0;
      if (!absl::SimpleAtod(arg, &ratio) || !(ratio >= 0 && ratio <= 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("OTEL_TRACES_SAMPLER_ARG=", arg, ": want a ratio in [0, 1]"));
      }
      s.ratio_ = ratio;
    }
    // ratio * 2^64 as an integer bound, compared with integers: as doubles, an id whose low
    // 64 bits round up to 2^64 was dropped at ratio 1.0. Below 1.0 the product is below
    // 2^64 (the largest double below 1 is 1 - 2^-53), so the cast is exact and in range.
    s.keep_all_ = s.ratio_ >= 1.0;
    s.bound_ = s.keep_all_ ? 0 : static_cast<uint64_t>(std::ldexp(s.ratio_, 64));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("OTEL_TRACES_SAMPLER=", name,
                     ": want always_on, always_off, traceidratio or parentbased_ one of those"));
  }
  return s;
}

bool Sampler::ShouldSample(const std::optional<TraceContext>& parent,
                           const TraceId& trace_id) const {
  if (parent_based_ && parent.has_value()) return parent->sampled();
  switch (root_) {
    case Root::kAlwaysOn:
      return true;
    case Root::kAlwaysOff:
      return false;
    case Root::kRatio: {
      // The spec's TraceIdRatioBased: the trace id's low 8 bytes against ratio * 2^64,
      // so every service with the same ratio keeps the same traces.
      if (keep_all_) return true;
      uint64_t low = 0;
      for (int i = 8; i < 16; ++i) low = low << 8 | trace_id[i];
      return low < bound_;
    }
  }
  return false;
}

std::string Sampler::Describe() const {
  const char* root = root_ == Root::kAlwaysOn    ? "always_on"
                     : root_ == Root::kAlwaysOff ? "always_off"
                                                 : "traceidratio";
  return absl::StrCat(parent_based_ ? "parentbased_" : "", root,
                      root_ == Root::kRatio ? absl::StrCat("(", ratio_, ")") : "");
}

}  // namespace eps::telemetry
