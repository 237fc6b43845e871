// Helpers shared by the algorithm files (internal).
#pragma once

#include <cstddef>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "ciuic/shm_layout.h"
#include "reduce/reduce.h"

namespace ciuic::daemon::internode_internal {

// dtype/op valid for Reduce, and not avg (the caller sums and divides once).
inline absl::Status CheckReduction(wire::DataType dtype, wire::ReduceOp op,
                                   const char* name) {
  if (absl::Status s = CheckReducible(dtype, op); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(name, ": ", s.message()));
  }
  if (op == wire::ReduceOp::kAvg) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": avg is not reduced between nodes; pass sum and DivideInPlace"));
  }
  return absl::OkStatus();
}

// Peer index arithmetic on a ring of n.
inline int Mod(long long a, int n) { return static_cast<int>(((a % n) + n) % n); }

}  // namespace ciuic::daemon::internode_internal
