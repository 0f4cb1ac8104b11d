// libFuzzer target: SelectPagesRequest validation and the step behind it. One
// session with inline buffers is attached once; each input, parsed as a
// SelectPagesRequest, runs against it (an empty session_id means that session;
// step 0 means the next step number), so fuzzed writes, rows and options reach
// the step. Every input must get a status: no crash, hang or sanitizer report.
// Run: scripts/fuzz.sh (docs/security.md).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "service/session_service.h"
#include "tests/fuzz/fuzz_session.h"

namespace {

struct Target {
  eps::service::SessionService selector{eps::fuzz::FuzzConfig()};
  std::string session_id;
  uint64_t next_step = 1;
};

Target& TheTarget() {
  static Target* target = [] {
    auto* t = new Target();
    eps::v1::AttachResponse response;
    const absl::Status s =
        t->selector.Attach(eps::fuzz::SmallInlineAttach("fuzz-engine"), &response);
    if (!s.ok()) {
      std::fprintf(stderr, "select_pages_fuzz: cannot attach: %s\n", s.ToString().c_str());
      std::abort();
    }
    t->session_id = response.session_id();
    return t;
  }();
  return *target;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Target& t = TheTarget();
  eps::v1::SelectPagesRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  if (request.session_id().empty()) request.set_session_id(t.session_id);
  if (request.step() == 0) request.set_step(t.next_step++);
  eps::v1::SelectPagesResponse response;
  (void)t.selector.SelectPages(request, &response);
  return 0;
}
