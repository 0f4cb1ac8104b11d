#include "core/visit_list.h"

#include <algorithm>

namespace eps {

int32_t WriteVisitList(std::span<const uint8_t> visit_groups, std::span<const int32_t> block_row,
                       int64_t num_blocks, int group_blocks, std::span<int32_t> out) {
  int32_t count = 0;
  for (size_t p = 0; p < visit_groups.size(); ++p) {
    if (!visit_groups[p]) continue;
    const int64_t begin = static_cast<int64_t>(p) * group_blocks;
    const int64_t end = std::min<int64_t>(begin + group_blocks, num_blocks);
    for (int64_t b = begin; b < end; ++b) out[count++] = block_row[b];
  }
  return count;
}

}  // namespace eps
