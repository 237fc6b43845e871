// Element-wise reduction of several equally typed buffers: the arithmetic
// step of every reducing collective (allreduce, reduce_scatter).
//
// Part of the contract between processes (it lives beside the shared-memory
// layout, not in the daemon): ciuicd reduces with it on its data path, and
// the SDK reduces with it on the single-node small-operation fast path
// (proto/ciuic/fast_path.h), so both paths give bit-for-bit the same result.
//
// Callers run Reduce from any thread on buffers they own for the duration of
// the call; the functions keep no state and are safe to call concurrently on
// disjoint outputs. The dtype and op of an operation come from untrusted
// shared memory: callers validate them once with CheckReducible when they
// accept a submission, and Reduce treats an invalid value as a broken
// invariant (it stops the process).
//
// Semantics (pinned down by reduce_test.cc, summarised in README.md):
//   out[i] = in[0][i] op in[1][i] op ... op in[n-1][i], folded left to right.
//   * float32, float64: accumulate in their own type. avg = sum / n.
//   * float16, bfloat16: widen to float32, accumulate in float32 left to right,
//     round once at the end (avg: the float32 sum / n, then round), to nearest
//     even, overflowing to Inf.
//   * Floating sum/prod/avg follow IEEE (NaN and Inf propagate). min/max give
//     NaN if any input is NaN, else the ordinary min/max (on a tie, such as -0
//     and +0, the earlier input wins).
//   * Integers: sum and prod wrap modulo 2^bits; avg is the wrapped sum
//     widened to int64/uint64 and divided by n, truncating toward zero;
//     min/max are ordinary.
//   * n == 1 copies, except avg, which divides by 1 (a signalling NaN then
//     becomes quiet).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "ciuic/shm_layout.h"

namespace ciuic::reduce {

// OK if Reduce supports `op` on `dtype` (every DataType x ReduceOp pair
// defined in shm_layout.h); INVALID_ARGUMENT naming the offending raw value
// otherwise.
absl::Status CheckReducible(wire::DataType dtype, wire::ReduceOp op);
// The same for raw values as read from shared memory.
absl::Status CheckReducible(uint32_t dtype, uint32_t op);

// Reduces `num_inputs` (>= 1) buffers of `count` elements of `dtype` into
// `out`. `out` may be exactly equal to any of the inputs (in place) but must
// not partially overlap any of them; inputs may alias each other. Inputs
// may sit at any address (a transport's receive buffer need not align
// them); `out` must be aligned to the element size. With count == 0 no
// pointer is dereferenced. Requires CheckReducible(dtype, op).ok().
void Reduce(wire::DataType dtype, wire::ReduceOp op, const void* const* inputs,
            int num_inputs, void* out, size_t count);

// avg's division on its own, in place: data[i] = data[i] / divisor with
// exactly the rounding and integer truncation (toward zero) that Reduce's
// kAvg applies to its sum, for a sum made elsewhere (between nodes).
// Vectorised like Reduce. Requires divisor >= 1 and a valid dtype; `data`
// aligned to the element size.
void DivideInPlace(wire::DataType dtype, void* data, size_t count, int divisor);

// The kernels are built for several instruction sets ("baseline": SSE2 on
// x86-64; "avx2"; "avx512": F, BW, DQ and VL, 512-bit vectors) and one is
// chosen per process on first use: the widest this CPU supports, or the one
// named by the environment variable CIUIC_REDUCE_ISA if the CPU has it. All
// give the same bits (no FMA, no reassociation; the payload of NaN + NaN,
// which is unspecified, aside), so processes that chose differently agree.
std::string_view ActiveIsa();
// Names of the builds this CPU can run, narrowest first ("baseline" always).
std::vector<std::string_view> SupportedIsas();
// Why CIUIC_REDUCE_ISA was not followed (an unknown name, or one this CPU
// lacks), for the caller's log; empty when it was, or is unset.
std::string IsaNote();
// Switches this process to another build (tests, benchmarks).
// INVALID_ARGUMENT for an unknown name, FAILED_PRECONDITION for one this CPU
// lacks.
absl::Status SetIsa(std::string_view name);

}  // namespace ciuic::reduce

// The daemon's code calls these unqualified from namespace ciuic::daemon.
namespace ciuic::daemon {
using reduce::CheckReducible;
using reduce::Reduce;
}  // namespace ciuic::daemon
