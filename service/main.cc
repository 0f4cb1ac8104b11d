// epsd: the EPS page selector sidecar (service/epsd_main.h).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "service/epsd_main.h"

int main(int argc, char** argv) {
  const int status = eps::service::RunEpsd(std::vector<std::string>(argv + 1, argv + argc));
  if (status == 1) {
    // A failed run, a lost device among them: everything epsd owns is gone by now, but a
    // stream it abandoned may still wait on an engine's memory for good (a never-draining
    // abandoned stream is one way to get here), and the CUDA runtime's exit-time teardown
    // must not wait for it. So no exit handlers.
    std::fflush(nullptr);
    std::_Exit(1);
  }
  return status;
}
