// Conversions between the eps.v1 messages and core/ and service types, the
// reply's visit lists included, and absl -> gRPC status.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/half.h"
#include "core/layout.h"
#include "core/select.h"
#include "core/step.h"
#include "eps/v1/page_selector.pb.h"
#include "google/protobuf/repeated_field.h"
#include "grpcpp/support/status.h"
#include "service/backend_kind.h"

namespace eps::service {

// Same code, same message.
grpc::Status ToGrpcStatus(const absl::Status& status);

absl::StatusOr<DType> FromProto(v1::DType dtype);
v1::DType ToProto(DType dtype);
const char* ProtoDTypeName(v1::DType dtype);

// Fills `defaults`' unset fields (group_blocks, sketch_dim, dtypes) and validates.
absl::StatusOr<ModelLayout> LayoutFromProto(const v1::ModelLayout& proto, int default_group_blocks,
                                            int default_sketch_dim);

// Returns `base` with every field that `options` sets replaced. A repeated field counts as set
// when non-empty: a non-empty mass_layers replaces base's whole list, an empty one keeps it.
absl::StatusOr<SelectPolicy> MergeOptions(const SelectPolicy& base,
                                          const v1::SelectOptions& options);
v1::SelectOptions ToProto(const SelectPolicy& policy);

void ToProto(const StepStats& stats, uint64_t step, double prepass_us, v1::StepStats* out);

// BACKEND_UNSPECIFIED is kAuto; an unknown value is INVALID_ARGUMENT.
absl::StatusOr<BackendKind> BackendFromProto(v1::Backend backend);
v1::Backend ToProto(BackendKind kind);  // kCpu or kCuda

std::vector<StepRow> RowsFromProto(const google::protobuf::RepeatedPtrField<v1::BatchRow>& rows);

// Visit lists in host memory, as core/step.h writes them:
//   blocks [layers, max_batch, lists, max_blocks], counts [layers, max_batch, lists] int32.
struct HostVisitLists {
  const int32_t* blocks = nullptr;
  const int32_t* counts = nullptr;
  int num_layers = 0;
  int64_t max_batch = 0;
  int lists = 1;  // 1 (union) or num_kv_heads (per KV head)
  int64_t max_blocks = 0;
  int block_size = 0;  // tokens per block, for visited_tokens
};
// Appends the lists of `rows` to the reply, layer-major, then row, then list.
void AppendVisitLists(const HostVisitLists& lists, std::span<const StepRow> rows,
                      v1::SelectPagesResponse* response);

}  // namespace eps::service
