// libFuzzer target: AttachRequest validation. Any bytes, parsed as an
// AttachRequest, must get a status (never a crash, a hang, a sanitizer report
// or an allocation past the memory limits); an accepted session is detached.
// Run: scripts/fuzz.sh (docs/security.md).
#include <cstddef>
#include <cstdint>
#include <memory>

#include "service/selector.h"
#include "tests/fuzz/fuzz_session.h"

namespace {

eps::service::Selector& TheSelector() {
  static auto* selector = new eps::service::Selector(eps::fuzz::FuzzConfig());
  return *selector;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  eps::v1::AttachRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  eps::v1::AttachResponse response;
  if (TheSelector().Attach(request, &response).ok()) {
    eps::v1::DetachRequest detach;
    detach.set_session_id(response.session_id());
    (void)TheSelector().Detach(detach);
  }
  return 0;
}
