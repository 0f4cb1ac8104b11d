// Conversions between the eps.v1 messages and core/ types, and absl -> gRPC status.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/half.h"
#include "core/layout.h"
#include "core/select.h"
#include "core/step.h"
#include "eps/v1/page_selector.pb.h"
#include "grpcpp/support/status.h"

namespace eps::service {

// Same code, same message.
grpc::Status ToGrpcStatus(const absl::Status& status);

absl::StatusOr<DType> FromProto(v1::DType dtype);
v1::DType ToProto(DType dtype);
const char* ProtoDTypeName(v1::DType dtype);

// Fills `defaults`' unset fields (group_blocks, sketch_dim, dtypes) and validates.
absl::StatusOr<ModelLayout> LayoutFromProto(const v1::ModelLayout& proto, int default_group_blocks,
                                            int default_sketch_dim);

// Returns `base` with every field that `options` sets replaced.
absl::StatusOr<SelectPolicy> MergeOptions(const SelectPolicy& base, const v1::SelectOptions& options);
v1::SelectOptions ToProto(const SelectPolicy& policy);

void ToProto(const StepStats& stats, uint64_t step, double prepass_us, v1::StepStats* out);

}  // namespace eps::service
