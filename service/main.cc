// epsd: the EPS page selector sidecar (service/epsd_main.h).
#include <string>
#include <vector>

#include "service/epsd_main.h"

int main(int argc, char** argv) {
  return eps::service::RunEpsd(std::vector<std::string>(argv + 1, argv + argc));
}
