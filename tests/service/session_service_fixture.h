// The session service in-process (no epsd process, no gRPC) over a test engine of two
// rows, and the request edits its tests share (session_service_test.cc: steps;
// session_attach_test.cc: Attach).
#pragma once

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "service/session_service.h"
#include "tests/core/test_util.h"
#include "tests/service/test_engine.h"

namespace eps::service {

// A session service of the default configuration, and an engine whose rows 0 and 1 hold
// 300 and 200 tokens of summaries (a fresh seed each run: seed_).
class SessionServiceTest : public ::testing::Test {
 protected:
  SessionServiceTest()
      : seed_(eps::testing::TestSeed()),
        engine_(eps::testing::SmallServiceModel(), /*max_seqs=*/2, /*max_context=*/512,
                /*max_batch=*/2, seed_) {
    engine_.Fill(0, 0, 300);
    engine_.Fill(1, 1, 200);
  }

  std::string Attach(const v1::AttachRequest& request) {
    v1::AttachResponse response;
    const absl::Status s = service_.Attach(request, &response);
    EXPECT_TRUE(s.ok()) << s;
    return response.session_id();
  }

  v1::SelectPagesRequest Step(const std::string& session, uint64_t step) {
    return eps::testing::TestEngine::Step(session, step, rows_);
  }

  uint64_t seed_;
  eps::testing::TestEngine engine_;
  ServerConfig config_;
  SessionService service_{config_};
  const std::vector<v1::BatchRow> rows_ = {eps::testing::TestEngine::Row(0, 300),
                                           eps::testing::TestEngine::Row(1, 200)};
};

// The visit lists and counts inline (the lists then come back in each reply), no flags.
inline void InlineOutputs(v1::AttachRequest& request) {
  for (v1::MemoryDescriptor* d : {request.mutable_buffers()->mutable_visit_blocks(),
                                  request.mutable_buffers()->mutable_visit_count()}) {
    d->mutable_inline_bytes()->set_data("");
    d->set_offset(0);
  }
  request.mutable_buffers()->clear_flags();
}

// Per-layer mass settings far apart (layer 0 keeps at most one unforced group per head,
// layer 1 nearly all its mass), so that lists from one shared setting would differ.
inline SelectPolicy PerLayerMassPolicy() {
  SelectPolicy p;
  p.budget = Budget::kMass;
  p.mass_layers = {{.target = 0.5f, .temperature = 1.0f, .min_pages = 0, .max_pages = 1},
                   {.target = 0.99f, .temperature = 2.0f, .min_pages = 2, .max_pages = 0}};
  return p;
}

inline void SetMassOptions(const SelectPolicy& p, v1::SelectOptions* o) {
  o->set_budget(v1::BUDGET_MASS);
  for (const MassSetting& m : p.mass_layers) {
    v1::MassSetting* out = o->add_mass_layers();
    out->set_target(m.target);
    out->set_temperature(m.temperature);
    out->set_min_pages(static_cast<uint32_t>(m.min_pages));
    out->set_max_pages(static_cast<uint32_t>(m.max_pages));
  }
}

}  // namespace eps::service
