#include "core/phi.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace eps {

float PhiScale(int m) { return 1.0f / std::sqrt(static_cast<float>(m)); }

absl::StatusOr<PhiBank> PhiBank::Create(uint64_t seed, int num_layers, int num_kv_heads,
                                        int head_dim, int sketch_dim) {
  if (num_layers <= 0 || num_layers > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers=", num_layers, " not in [1, 65535]"));
  }
  if (num_kv_heads <= 0 || num_kv_heads > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_kv_heads=", num_kv_heads, " not in [1, 65535]"));
  }
  if (head_dim <= 0 || sketch_dim <= 0 ||
      static_cast<int64_t>(head_dim) * sketch_dim > (int64_t{1} << 31)) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim=", head_dim, ", sketch_dim=", sketch_dim, " out of range"));
  }
  PhiBank bank;
  bank.seed_ = seed;
  bank.num_layers_ = num_layers;
  bank.num_kv_heads_ = num_kv_heads;
  bank.head_dim_ = head_dim;
  bank.sketch_dim_ = sketch_dim;
  const size_t per_matrix = static_cast<size_t>(head_dim) * sketch_dim;
  bank.values_.resize(per_matrix * num_layers * num_kv_heads);
  const float scale = PhiScale(sketch_dim);
  float* out = bank.values_.data();
  for (int layer = 0; layer < num_layers; ++layer) {
    for (int head = 0; head < num_kv_heads; ++head) {
      for (uint32_t index = 0; index < per_matrix; ++index) {
        *out++ = PhiSign(seed, layer, head, index) > 0 ? scale : -scale;
      }
    }
  }
  return bank;
}

void PhiBank::Project(int layer, int kv_head, std::span<const float> q, std::span<float> z) const {
  const std::span<const float> phi = Matrix(layer, kv_head);
  const int m = sketch_dim_;
  for (int j = 0; j < m; ++j) z[j] = 0.0f;
  for (int i = 0; i < head_dim_; ++i) {
    const float qi = q[i];
    const float* row = phi.data() + static_cast<size_t>(i) * m;
    for (int j = 0; j < m; ++j) z[j] += row[j] * qi;
  }
}

absl::Status PhiCovers(const PhiBank& phi, const ModelLayout& model) {
  if (phi.seed() != model.phi_seed || phi.head_dim() != model.head_dim ||
      phi.sketch_dim() != model.sketch_dim || phi.num_layers() < model.num_layers ||
      phi.num_kv_heads() < model.num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PhiBank (seed=", phi.seed(), ", layers=", phi.num_layers(),
        ", kv_heads=", phi.num_kv_heads(), ", d=", phi.head_dim(), ", m=", phi.sketch_dim(),
        ") does not serve the model (", model.DebugString(), ")"));
  }
  return absl::OkStatus();
}

}  // namespace eps
