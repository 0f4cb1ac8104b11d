// The float64 reference (eps_attn_reference_host) and the C ABI's host-only entry
// points. Plain C++: built and tested without CUDA, so CI checks the semantics the
// kernels are tested against on the GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gpu/attention/paged_attention.h"
#include "gpu/attention/params_check.h"
#include "gpu/attention/row_list.h"

namespace eps::attention {
namespace {

double Bf16ToDouble(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}

double Fp16ToDouble(uint16_t bits) {
  const int sign = bits >> 15;
  const int exponent = (bits >> 10) & 31;
  const int mantissa = bits & 1023;
  double magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -24);
  } else if (exponent == 31) {
    magnitude = mantissa == 0 ? INFINITY : NAN;
  } else {
    magnitude = std::ldexp(1024 + mantissa, exponent - 25);
  }
  return sign ? -magnitude : magnitude;
}

// Reads element i of a bf16 / fp16 array.
double Load(const void* base, int64_t i, int32_t dtype) {
  const uint16_t bits = static_cast<const uint16_t*>(base)[i];
  return dtype == EPS_ATTN_BF16 ? Bf16ToDouble(bits) : Fp16ToDouble(bits);
}

// The feedback of (row, query head qh of KV head h) over its list (paged_attention.h):
// each listed block's log-sum-exp of `scores`, combined into its group's entry of
// feedback (laid out as params' feedback; NaN = no value yet).
int32_t AddFeedback(const EpsAttnParams& p, int64_t row, int64_t h, int64_t qh, const RowList& list,
                    const std::vector<double>& scores, double* feedback) {
  for (int32_t i = 0; i < list.count; ++i) {
    const int32_t first = i * p.block_size;
    const int32_t end = std::min<int32_t>(first + p.block_size, list.tokens);
    double top = -INFINITY;
    for (int32_t t = first; t < end; ++t) top = std::max(top, scores[t]);
    double sum = 0.0;
    for (int32_t t = first; t < end; ++t) sum += std::exp(scores[t] - top);
    const double x = top + std::log(sum);
    int32_t error = kListOk;
    int32_t value = 0;
    const int64_t entry = FeedbackEntry(p, row, qh, list.blocks[i], &error, &value);
    if (error != kListOk) {
      const int32_t word[EPS_ATTN_ERROR_WORDS] = {error, static_cast<int32_t>(row),
                                                  static_cast<int32_t>(h), value};
      return Fail(EPS_ATTN_ELIST, DescribeListError(word));
    }
    double& slot = feedback[entry];
    if (std::isnan(slot)) {
      slot = x;
    } else {
      const double hi = std::max(slot, x);
      slot = hi + std::log1p(std::exp(std::min(slot, x) - hi));
    }
  }
  return EPS_ATTN_OK;
}

}  // namespace
}  // namespace eps::attention

extern "C" uint64_t eps_attn_params_size(void) { return sizeof(EpsAttnParams); }

extern "C" int32_t eps_attn_abi_version(void) { return EPS_ATTN_ABI_VERSION; }

extern "C" int32_t eps_attn_reference_host(const EpsAttnParams* params, double* out_f64,
                                           double* lse_f64, double* feedback_f64) {
  using namespace eps::attention;
  if (params == nullptr) return Fail(EPS_ATTN_EINVAL, "params is NULL");
  const EpsAttnParams& p = *params;
  if (std::string why = CheckParams(p, /*check_pointers=*/false); !why.empty()) {
    return Fail(EPS_ATTN_EINVAL, why);
  }
  if (p.q == nullptr || p.k_cache == nullptr || p.v_cache == nullptr || p.lists == nullptr ||
      p.lengths == nullptr || out_f64 == nullptr ||
      (p.length_kind == EPS_ATTN_VISIT_COUNT &&
       (p.dense_table == nullptr || p.context_lens == nullptr)) ||
      (p.feedback != nullptr && p.block_positions == nullptr)) {
    return Fail(EPS_ATTN_EINVAL, "a pointer the reference reads or writes is NULL");
  }
  const int group = p.num_q_heads / p.num_kv_heads;
  const int d = p.head_dim;
  std::vector<double> scores;
  std::vector<double> acc(d);
  for (int64_t row = 0; row < p.batch; ++row) {
    for (int64_t h = 0; h < p.num_kv_heads; ++h) {
      const RowList list = ResolveRow(p, row, h);
      int32_t word[EPS_ATTN_ERROR_WORDS] = {list.error, static_cast<int32_t>(row),
                                            static_cast<int32_t>(h), list.value};
      if (list.error != kListOk) return Fail(EPS_ATTN_ELIST, DescribeListError(word));
      for (int32_t i = 0; i < list.count; ++i) {
        if (list.blocks[i] < 0 || list.blocks[i] >= p.num_blocks) {
          word[0] = kListBlockId;
          word[3] = list.blocks[i];
          return Fail(EPS_ATTN_ELIST, DescribeListError(word));
        }
      }
      for (int g = 0; g < group; ++g) {
        const int64_t qh = h * group + g;
        const int64_t q_base = row * p.q_stride_row + qh * p.q_stride_head;
        scores.assign(list.tokens, 0.0);
        double max_score = -INFINITY;
        for (int32_t t = 0; t < list.tokens; ++t) {
          const int64_t k_base = list.blocks[t / p.block_size] * p.kv_stride_block +
                                 (t % p.block_size) * p.kv_stride_token + h * p.kv_stride_head;
          double dot = 0.0;
          for (int e = 0; e < d; ++e) {
            dot += Load(p.q, q_base + e, p.dtype) * Load(p.k_cache, k_base + e, p.dtype);
          }
          double s = dot * p.softmax_scale;
          if (p.softcap > 0.0f) s = p.softcap * std::tanh(s / p.softcap);
          scores[t] = s;
          max_score = std::max(max_score, s);
        }
        if (max_score == -INFINITY) {
          // Every score -inf (keys of -inf): nothing to attend to. The kernels write
          // zeros and lse -inf for such a row; so does the reference, not NaN.
          for (int e = 0; e < d; ++e) out_f64[(row * p.num_q_heads + qh) * d + e] = 0.0;
          if (lse_f64 != nullptr) lse_f64[row * p.num_q_heads + qh] = -INFINITY;
          continue;
        }
        double total = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int32_t t = 0; t < list.tokens; ++t) {
          const double w = std::exp(scores[t] - max_score);
          total += w;
          const int64_t v_base = list.blocks[t / p.block_size] * p.kv_stride_block +
                                 (t % p.block_size) * p.kv_stride_token + h * p.kv_stride_head;
          for (int e = 0; e < d; ++e) acc[e] += w * Load(p.v_cache, v_base + e, p.dtype);
        }
        for (int e = 0; e < d; ++e) out_f64[(row * p.num_q_heads + qh) * d + e] = acc[e] / total;
        if (lse_f64 != nullptr) lse_f64[row * p.num_q_heads + qh] = max_score + std::log(total);
        if (feedback_f64 != nullptr && p.feedback != nullptr) {
          if (int32_t code = AddFeedback(p, row, h, qh, list, scores, feedback_f64);
              code != EPS_ATTN_OK) {
            return code;
          }
        }
      }
    }
  }
  return Succeed();
}
