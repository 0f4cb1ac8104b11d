// The policies the coarse-level tests run (tests/core/coarse_step_test.cc and
// tests/gpu/coarse_step_gpu_test.cc): every budget over one granularity.
#pragma once

#include <vector>

#include "core/select.h"

namespace eps::testing {

// Threshold (questclt, quest), fixed (jl), top-p (0.8 and 1), mass (head and list scope,
// floors within and beyond the candidates): a rule with fewer candidates than its budget
// or a floor beyond them marks unscored groups, which the level must drop.
inline std::vector<SelectPolicy> CoarsePolicies(Granularity granularity, float coarse_candidates) {
  std::vector<SelectPolicy> out;
  SelectPolicy p;
  p.granularity = granularity;
  p.top_pages = 6;
  p.coarse_candidates = coarse_candidates;
  out.push_back(p);  // threshold, questclt
  p.method = Method::kQuest;
  p.alpha = 1.5f;
  out.push_back(p);
  p.method = Method::kJl;
  p.alpha = 1.0f;
  p.budget = Budget::kFixed;
  out.push_back(p);
  p.method = Method::kQuestClt;
  p.budget = Budget::kTopP;
  p.top_p = 0.8f;
  out.push_back(p);
  p.budget = Budget::kMass;
  p.mass_target = 0.9f;
  p.min_pages = 1;
  p.max_pages = 20;
  out.push_back(p);
  p.mass_scope = MassScope::kList;
  out.push_back(p);
  p.min_pages = 300;
  p.max_pages = 0;
  out.push_back(p);
  p.mass_scope = MassScope::kHead;
  out.push_back(p);
  p.budget = Budget::kTopP;
  p.top_p = 1.0f;
  out.push_back(p);
  return out;
}

}  // namespace eps::testing
