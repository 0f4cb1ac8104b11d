// Visit lists (docs/design.md §5): the blocks a sequence's attention reads this step.
//
// A visit list is a row of physical block ids taken from the sequence's block
// table in ascending logical order, so the last (possibly partial) block is
// last and a FlashAttention-style kernel can use it as a block table with
// seqused_k = VisitedTokens(...).
#pragma once

#include <cstdint>
#include <span>

namespace eps {

// Writes the blocks of the marked groups into `out`; returns how many.
// `block_row` holds the sequence's physical block ids by logical block;
// `num_blocks` logical blocks are in use; group p covers logical blocks
// [p*group_blocks, min((p+1)*group_blocks, num_blocks)). `out` must hold
// num_blocks entries.
int32_t WriteVisitList(std::span<const uint8_t> visit_groups, std::span<const int32_t> block_row,
                       int64_t num_blocks, int group_blocks, std::span<int32_t> out);

// Tokens in a visit list of `visited_blocks` blocks that ends with the
// sequence's last block: what a kernel passes as seqused_k.
inline int64_t VisitedTokens(int64_t visited_blocks, int64_t context_tokens, int block_size) {
  if (visited_blocks == 0) return 0;
  const int64_t last_block_tokens = context_tokens - (context_tokens - 1) / block_size * block_size;
  return (visited_blocks - 1) * block_size + last_block_tokens;
}

}  // namespace eps
