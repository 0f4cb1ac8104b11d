#include "core/summary.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"

namespace eps {
namespace {

// Widens key `t` of `keys` into `out` (head_dim floats).
void LoadKey(const KeyRows& keys, int head_dim, int64_t t, float* out) {
  const int64_t stride = keys.stride == 0 ? head_dim : keys.stride;
  const int64_t base = t * stride;
  for (int i = 0; i < head_dim; ++i) out[i] = LoadAsFloat(keys.data, keys.dtype, base + i);
}

uint16_t* QuestHalves(std::span<float> record, int word) {
  return reinterpret_cast<uint16_t*>(record.data() + word);
}

int8_t* PrincipalBytes(std::span<float> record, const SummaryLayout& layout) {
  return reinterpret_cast<int8_t*>(record.data() + layout.principal + 3);
}

int8_t* Quest8Codes(std::span<float> record, const SummaryLayout& layout, int run) {
  return reinterpret_cast<int8_t*>(record.data() + layout.quest8 + run * layout.head_dim / 4);
}

// Folds key k (d floats) into the quest8 part. When the key needs a larger
// scale (a power of two, 2^j times the old one) the codes are requantized
// first: floor(c / 2^j) for minima, ceil(c / 2^j) for maxima, which is what
// quantizing the old keys at the new scale would give, so the record is the
// same whatever the order of its keys.
void FoldQuest8(std::span<float> record, const SummaryLayout& layout, const float* k) {
  const int d = layout.head_dim;
  int8_t* lo = Quest8Codes(record, layout, 0);
  int8_t* hi = Quest8Codes(record, layout, 1);
  float& scale = record[layout.quest8 + d / 2];
  float amax = 0.0f;
  for (int i = 0; i < d; ++i) amax = std::max(amax, std::abs(k[i]));
  if (amax > 127.0f * scale) {
    const float grown = Quest8ScaleFor(amax);
    if (scale > 0.0f) {
      int shift = 0;
      while (std::ldexp(scale, shift) < grown) ++shift;
      for (int i = 0; i < d; ++i) {
        lo[i] = static_cast<int8_t>(shift >= 8 ? (lo[i] < 0 ? -1 : 0) : lo[i] >> shift);
        const int neg = -static_cast<int>(hi[i]);
        hi[i] = static_cast<int8_t>(shift >= 8 ? (neg < 0 ? 1 : 0) : -(neg >> shift));
      }
    }
    scale = grown;
  }
  for (int i = 0; i < d; ++i) {
    // k / scale is within ±127 and exact (a power of two) unless it falls below the float
    // range (a channel many powers of two under the key's largest): it rounds to 0 then,
    // and its codes follow the key's sign, as floor and ceil of the exact quotient do.
    // All-zero keys at scale 0 code 0.
    const float x = scale > 0.0f ? k[i] / scale : 0.0f;
    const int down = x != 0.0f ? static_cast<int>(std::floor(x)) : (k[i] < 0.0f ? -1 : 0);
    const int up = x != 0.0f ? static_cast<int>(std::ceil(x)) : (k[i] > 0.0f ? 1 : 0);
    lo[i] = static_cast<int8_t>(std::min<int>(lo[i], down));
    hi[i] = static_cast<int8_t>(std::max<int>(hi[i], up));
  }
}

}  // namespace

float Quest8ScaleFor(float amax) {
  int exponent = 0;
  std::frexp(amax, &exponent);  // amax = f·2^exponent, f in [0.5, 1)
  int e = exponent - 7;         // 127·2^(e-1) < 2^(exponent-1) <= amax
  if (std::ldexp(127.0f, e) < amax) ++e;
  return std::ldexp(1.0f, std::max(e, -149));
}

int8_t PrincipalComponent(std::span<const float> record, const SummaryLayout& layout, int i) {
  return reinterpret_cast<const int8_t*>(record.data() + layout.principal + 3)[i];
}

SummaryWriter::SummaryWriter(const ModelLayout& model, const PhiBank& phi)
    : model_(model), layout_(SummaryLayout::For(model)), phi_(phi) {}

absl::Status ResetRecord(const SummaryLayout& layout, std::span<float> record) {
  if (static_cast<int64_t>(record.size()) < layout.record_words) {
    return absl::InvalidArgumentError(
        absl::StrCat("record has ", record.size(), " words, layout needs ", layout.record_words));
  }
  std::fill(record.begin(), record.begin() + layout.record_words, 0.0f);
  if (layout.quest_min >= 0) {
    std::fill_n(QuestHalves(record, layout.quest_min), layout.head_dim, uint16_t{0x7C00});  // +inf
    std::fill_n(QuestHalves(record, layout.quest_max), layout.head_dim, uint16_t{0xFC00});  // -inf
  }
  if (layout.quest8 >= 0) {
    std::fill_n(Quest8Codes(record, layout, 0), layout.head_dim, int8_t{127});
    std::fill_n(Quest8Codes(record, layout, 1), layout.head_dim, int8_t{-128});
  }
  return absl::OkStatus();
}

absl::Status SummaryWriter::Reset(std::span<float> record) const {
  return ResetRecord(layout_, record);
}

absl::Status SummaryWriter::CheckKeys(std::span<float> record, int layer, int kv_head,
                                      const KeyRows& keys, bool appending) const {
  if (static_cast<int64_t>(record.size()) < layout_.record_words) {
    return absl::InvalidArgumentError(
        absl::StrCat("record has ", record.size(), " words, layout needs ", layout_.record_words));
  }
  if (layer < 0 || layer >= model_.num_layers || kv_head < 0 || kv_head >= model_.num_kv_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("(layer, kv_head)=(", layer, ", ", kv_head, ") out of range"));
  }
  if (absl::Status s = PhiCovers(phi_, model_); !s.ok()) return s;
  if (keys.dtype != DType::kFloat32 && keys.dtype != DType::kFloat16 &&
      keys.dtype != DType::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("key dtype ", DTypeName(keys.dtype), " is not a float type"));
  }
  if (keys.count < 0 || (keys.count > 0 && keys.data == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("bad key rows: count=", keys.count));
  }
  if (keys.stride != 0 && keys.stride < model_.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("key stride=", keys.stride, " < head_dim=", model_.head_dim));
  }
  std::vector<float> k(model_.head_dim);
  // Σ‖k‖² of the record's keys after the append, in double: fro2 is its float sum, and
  // every Gram term |Σ y_i·y_j| <= Σ‖Φk‖² <= d·Σ‖k‖² (Φ's entries are ±1/√m).
  double fro2 = appending ? std::max(0.0f, record[layout_.fro2]) : 0.0;
  for (int64_t t = 0; t < keys.count; ++t) {
    LoadKey(keys, model_.head_dim, t, k.data());
    for (int i = 0; i < model_.head_dim; ++i) {
      if (!std::isfinite(k[i])) {
        return absl::InvalidArgumentError(absl::StrCat("key ", t, " element ", i, " is ", k[i],
                                                       " (layer ", layer, ", kv_head ", kv_head,
                                                       ")"));
      }
      if (layout_.quest_min >= 0 && std::abs(k[i]) > kHalfMax) {
        return absl::InvalidArgumentError(absl::StrCat(
            "key ", t, " element ", i, " is ", k[i], " (layer ", layer, ", kv_head ", kv_head,
            "): beyond the binary16 range of the quest summary, |k| <= 65504"));
      }
    }
    for (int i = 0; i < model_.head_dim; ++i) fro2 += double{k[i]} * k[i];
    if (fro2 * model_.head_dim >= std::numeric_limits<float>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("key ", t, " (layer ", layer, ", kv_head ", kv_head,
                       ") brings the record's sum of squared "
                       "key norms to ",
                       fro2, ": its sums would leave the float range (d * sum must stay below ",
                       std::numeric_limits<float>::max(), ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status SummaryWriter::Append(std::span<float> record, int layer, int kv_head,
                                   const KeyRows& keys) const {
  if (absl::Status s = CheckKeys(record, layer, kv_head, keys, /*appending=*/true); !s.ok()) {
    return s;
  }
  const int d = model_.head_dim;
  const int m = model_.sketch_dim;
  std::vector<float> k(d), y(m);
  float* gram = record.data();
  float& fro2 = record[layout_.fro2];
  float& max_norm = record[layout_.max_norm];
  float& count = record[layout_.count];
  if (layout_.principal >= 0 && keys.count > 0) {
    record[layout_.principal + 2] = 0.0f;  // a principal pair describes the sealed keys only
  }
  for (int64_t t = 0; t < keys.count; ++t) {
    LoadKey(keys, d, t, k.data());
    phi_.Project(layer, kv_head, k, y);
    for (int i = 0, p = 0; i < m; ++i) {
      for (int j = i; j < m; ++j, ++p) gram[p] += y[i] * y[j];
    }
    float norm2 = 0.0f;
    for (int i = 0; i < d; ++i) norm2 += k[i] * k[i];
    fro2 += norm2;
    max_norm = std::max(max_norm, std::sqrt(norm2));
    count += 1.0f;
    if (layout_.key_sum >= 0) {
      float* sum = record.data() + layout_.key_sum;
      for (int i = 0; i < d; ++i) sum[i] += k[i];
    }
    if (layout_.quest_min >= 0) {
      // Rounded outward, so min ≤ every key and max ≥ every key still hold.
      uint16_t* lo = QuestHalves(record, layout_.quest_min);
      uint16_t* hi = QuestHalves(record, layout_.quest_max);
      for (int i = 0; i < d; ++i) {
        if (k[i] < HalfToFloat(lo[i])) lo[i] = FloatToHalfDown(k[i]);
        if (k[i] > HalfToFloat(hi[i])) hi[i] = FloatToHalfUp(k[i]);
      }
    }
    if (layout_.quest8 >= 0) FoldQuest8(record, layout_, k.data());
  }
  return absl::OkStatus();
}

absl::Status SummaryWriter::Seal(std::span<float> record, int layer, int kv_head,
                                 const KeyRows& keys) const {
  if (layout_.principal < 0) return absl::OkStatus();
  if (absl::Status s = CheckKeys(record, layer, kv_head, keys, /*appending=*/false); !s.ok()) {
    return s;
  }
  if (static_cast<float>(keys.count) != record[layout_.count]) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Seal got ", keys.count, " keys but the record summarises ", record[layout_.count]));
  }
  const int d = model_.head_dim;
  std::vector<float> all(static_cast<size_t>(keys.count) * d);
  for (int64_t t = 0; t < keys.count; ++t) LoadKey(keys, d, t, all.data() + t * d);

  // Power iteration v <- Kᵀ(K v), started from the longest key, in double.
  std::vector<double> v(d, 0.0), next(d);
  double best = -1.0;
  for (int64_t t = 0; t < keys.count; ++t) {
    double n2 = 0;
    for (int i = 0; i < d; ++i) n2 += double{all[t * d + i]} * all[t * d + i];
    if (n2 > best) {
      best = n2;
      for (int i = 0; i < d; ++i) v[i] = all[t * d + i];
    }
  }
  constexpr int kIterations = 32;
  for (int it = 0; it < kIterations && best > 0; ++it) {
    std::fill(next.begin(), next.end(), 0.0);
    for (int64_t t = 0; t < keys.count; ++t) {
      const float* k = all.data() + t * d;
      double dot = 0;
      for (int i = 0; i < d; ++i) dot += k[i] * v[i];
      for (int i = 0; i < d; ++i) next[i] += dot * k[i];
    }
    double norm = 0;
    for (double x : next) norm += x * x;
    norm = std::sqrt(norm);
    if (norm == 0) break;
    for (int i = 0; i < d; ++i) v[i] = next[i] / norm;
  }

  // Quantise to int8 and measure λ1 along the dequantised unit direction.
  float* pc = record.data() + layout_.principal;
  int8_t* u = PrincipalBytes(record, layout_);
  double peak = 0;
  for (double x : v) peak = std::max(peak, std::abs(x));
  if (peak == 0 || keys.count == 0) {
    std::fill_n(pc, 3, 0.0f);  // scale 0: no principal pair; the 1pc bound falls back to fro
    std::fill_n(u, d, int8_t{0});
    return absl::OkStatus();
  }
  float unorm2 = 0.0f;
  for (int i = 0; i < d; ++i) {
    u[i] = static_cast<int8_t>(std::lround(v[i] / peak * 127.0));
    unorm2 += static_cast<float>(u[i]) * u[i];
  }
  const float scale = 1.0f / std::sqrt(unorm2);
  float lambda = 0.0f;
  for (int64_t t = 0; t < keys.count; ++t) {
    float dot = 0.0f;
    for (int i = 0; i < d; ++i) dot += all[t * d + i] * (u[i] * scale);
    lambda += dot * dot;
  }
  pc[0] = lambda;
  pc[1] = std::max(record[layout_.fro2] - lambda, 0.0f);
  pc[2] = scale;
  return absl::OkStatus();
}

}  // namespace eps
