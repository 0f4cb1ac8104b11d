// libFuzzer target: AttachRequest validation. Any bytes, parsed as an
// AttachRequest, must get a status (never a crash, a hang, a sanitizer report
// or an allocation past the memory limits); an accepted session is detached.
// Run: scripts/fuzz.sh (docs/security.md).
#include <cstddef>
#include <cstdint>
#include <memory>

#include "service/session_service.h"
#include "tests/fuzz/fuzz_session.h"

namespace {

eps::service::SessionService& TheService() {
  static auto* selector = new eps::service::SessionService(eps::fuzz::FuzzConfig());
  return *selector;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  eps::v1::AttachRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  eps::v1::AttachResponse response;
  if (TheService().Attach(request, &response).ok()) {
    eps::v1::DetachRequest detach;
    detach.set_session_id(response.session_id());
    (void)TheService().Detach(detach);
  }
  return 0;
}
