// Host-side checks of EpsAttnParams and the thread's last error message: shared by the
// CUDA entry points (paged_attention.cu) and the float64 reference (reference.cc).
#pragma once

#include <string>

#include "gpu/attention/paged_attention.h"

namespace eps::attention {

// "" when the host-visible fields are valid, else a message naming the field and its
// value. check_pointers: also require the pointers a call dereferences (and their
// 16-byte alignment where vector loads read them).
std::string CheckParams(const EpsAttnParams& p, bool check_pointers);

// Stores `message` as this thread's eps_attn_last_error() and returns `code`.
int32_t Fail(int32_t code, std::string message);

// Clears this thread's message and returns EPS_ATTN_OK.
int32_t Succeed();

// The message of an error word's contents ([code, row, kv_head, value]).
std::string DescribeListError(const int32_t word[EPS_ATTN_ERROR_WORDS]);

}  // namespace eps::attention
