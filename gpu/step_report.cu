#include "absl/strings/str_cat.h"
#include "gpu/step_report.cuh"

namespace eps::gpu {

using namespace kernels;  // NOLINT: the report's codes

absl::Status ReportStatus(const DeviceStatus& status, const ReportBounds& bounds) {
  const auto table_row = [&] { return bounds.rows[status.row].table_row; };
  switch (status.code) {
    case kOk:
      return absl::OkStatus();
    case kBadSlot:
      return absl::InvalidArgumentError(absl::StrCat("group_table[", table_row(), "][",
                                                     status.index, "]=", status.value,
                                                     " not in [0, ", bounds.num_slots, ")"));
    case kBadBlock:
      return absl::InvalidArgumentError(absl::StrCat("block_table[", table_row(), "][",
                                                     status.index, "]=", status.value,
                                                     " not in [0, ", bounds.physical_blocks, ")"));
    case kBadScore:
    case kBadCoarseScore:
      return absl::InvalidArgumentError(
          absl::StrCat(status.code == kBadCoarseScore ? "coarse summary" : "summary", " of slot ",
                       status.value, " gives a non-finite score: the summary holds NaN or Inf"));
    case kBadCoarseSlot:
      return absl::InvalidArgumentError(absl::StrCat("coarse_table[", table_row(), "][",
                                                     status.index, "]=", status.value,
                                                     " not in [0, ", bounds.coarse_slots, ")"));
    case kBadQuery:
      return absl::InvalidArgumentError(
          absl::StrCat("query of row ", status.row, " element ", status.index, " is not finite"));
    case kQueryOverflow:
      return absl::InvalidArgumentError(
          absl::StrCat("query[layer ", status.index / status.value, "][row ", status.row, "][head ",
                       status.index % status.value, "] has |q|^2 >= ", kMaxQueryNorm2,
                       ", beyond the float range of the scores"));
    case kReleased:
      return absl::DeadlineExceededError(
          "the step's inputs wait was released: every list says attend densely (-1)");
    default:
      return absl::InternalError(absl::StrCat("unknown device status code ", status.code));
  }
}

}  // namespace eps::gpu
