#include "bench/gpu_policy_cases.h"

namespace eps::bench {

std::vector<PolicyCase> PolicyCases(int top_pages) {
  std::vector<PolicyCase> cases;
  auto add = [&](const char* name, SummaryFeatures f, auto edit) {
    SelectPolicy p;
    p.top_pages = top_pages;
    // The default method (questclt) needs a quest part.
    if (!f.quest && !f.quest8) p.method = Method::kJl;
    edit(p);
    cases.push_back({name, f, p});
  };
  const SummaryFeatures minimal{.key_sum = false, .principal = false, .quest = false};
  const SummaryFeatures quest{.key_sum = false, .principal = false, .quest = true};
  const SummaryFeatures bracket{.key_sum = true, .principal = false, .quest = true};
  const SummaryFeatures quest8{.key_sum = false, .principal = false, .quest = true, .quest8 = true};
  const SummaryFeatures quest8_only{
      .key_sum = false, .principal = false, .quest = false, .quest8 = true};
  const SummaryFeatures bracket8{
      .key_sum = true, .principal = false, .quest = true, .quest8 = true};
  add("jl threshold", minimal, [](SelectPolicy&) {});
  add("jl threshold per_kv_head", minimal,
      [](SelectPolicy& p) { p.granularity = Granularity::kPerKvHead; });
  add("jl fixed", minimal, [](SelectPolicy& p) { p.budget = Budget::kFixed; });
  add("jl fixed per_kv_head", minimal, [](SelectPolicy& p) {
    p.budget = Budget::kFixed;
    p.granularity = Granularity::kPerKvHead;
  });
  add("jl top_p 0.95", minimal, [](SelectPolicy& p) { p.budget = Budget::kTopP; });
  add("quest threshold (16-bit)", quest, [](SelectPolicy& p) { p.method = Method::kQuest; });
  add("quest fixed (16-bit)", quest, [](SelectPolicy& p) {
    p.method = Method::kQuest;
    p.budget = Budget::kFixed;
  });
  add("questclt threshold", quest, [](SelectPolicy& p) { p.method = Method::kQuestClt; });
  add("questclt threshold (registers)", quest,
      [](SelectPolicy& p) { p.method = Method::kQuestClt; });
  cases.back().options.register_sums = true;  // questclt's general path (gpu/step.h)
  // The reference engine's record (key_sum and quest: 1,184 bytes at d = 128).
  add("questclt threshold key_sum", bracket, [](SelectPolicy& p) { p.method = Method::kQuestClt; });
  // questclt over the quest8 part (2·d + 4 of the record's bytes instead of 4·d).
  add("questclt threshold quest8", quest8, [](SelectPolicy& p) { p.method = Method::kQuestClt; });
  add("questclt threshold quest8 (registers)", quest8,
      [](SelectPolicy& p) { p.method = Method::kQuestClt; });
  cases.back().options.register_sums = true;
  add("questclt threshold quest8 only", quest8_only,
      [](SelectPolicy& p) { p.method = Method::kQuestClt; });
  add("questclt threshold key_sum quest8", bracket8,
      [](SelectPolicy& p) { p.method = Method::kQuestClt; });
  add("quest mass 0.95", quest, [](SelectPolicy& p) {
    p.method = Method::kQuest;
    p.budget = Budget::kMass;
  });
  add("quest mass 0.95 list", quest, [](SelectPolicy& p) {
    p.method = Method::kQuest;
    p.budget = Budget::kMass;
    p.mass_scope = MassScope::kList;
  });
  add("questclt mass 0.95 list", quest, [](SelectPolicy& p) {
    p.method = Method::kQuestClt;
    p.budget = Budget::kMass;
    p.mass_scope = MassScope::kList;
  });
  add("strict (key_sum + quest)", bracket, [](SelectPolicy& p) { p.strict = true; });
  return cases;
}

}  // namespace eps::bench
