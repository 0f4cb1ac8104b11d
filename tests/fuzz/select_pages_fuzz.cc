// libFuzzer target: SelectPagesRequest validation and the step behind it. Two
// sessions with inline buffers are attached once, one with a coarse level; each
// input, parsed as a SelectPagesRequest, runs against one of them (an empty
// session_id means the flat session, "coarse" the coarse one; step 0 means the next
// step number), so fuzzed writes, rows and options reach the step. Every input must get a status:
// no crash, hang or sanitizer report. Run: scripts/fuzz.sh (docs/security.md).
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
  std::string session_id, coarse_session_id;
  uint64_t next_step = 1;
};

std::string AttachOrAbort(eps::service::SessionService& selector,
                          const eps::v1::AttachRequest& request) {
  eps::v1::AttachResponse response;
  const absl::Status s = selector.Attach(request, &response);
  if (!s.ok()) {
    std::fprintf(stderr, "select_pages_fuzz: cannot attach: %s\n", s.ToString().c_str());
    std::abort();
  }
  return response.session_id();
}

Target& TheTarget() {
  static Target* target = [] {
    auto* t = new Target();
    t->session_id = AttachOrAbort(t->selector, eps::fuzz::SmallInlineAttach("fuzz-engine"));
    t->coarse_session_id =
        AttachOrAbort(t->selector, eps::fuzz::SmallInlineCoarseAttach("fuzz-coarse-engine"));
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
  if (request.session_id() == "coarse") request.set_session_id(t.coarse_session_id);
  if (request.step() == 0) request.set_step(t.next_step++);
  eps::v1::SelectPagesResponse response;
  (void)t.selector.SelectPages(request, &response);
  return 0;
}
