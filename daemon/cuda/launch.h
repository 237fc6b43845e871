// Launch geometry and CUDA error mapping for the device kernels; internal to
// daemon/cuda. Pure functions, callable from any thread; launch.cc is plain
// C++ (no device code), so these are tested on machines without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ciuic::daemon::gpu {

// Threads per block of the element-wise kernels.
inline constexpr unsigned kThreadsPerBlock = 256;
// The element-wise kernels loop over their items (grid stride) once the grid
// reaches this many blocks: 2 Mi threads, several full waves on the largest
// GPUs (an H200 holds 132 x 2048 resident threads).
inline constexpr unsigned kMaxBlocks = 8192;

struct LaunchShape {
  unsigned blocks = 0;   // 0 only when there is nothing to do
  unsigned threads = 0;
};

// The grid for `items` independent work items of `threads_per_block` threads
// each handling one item per pass: ceil(items / threads) blocks, at most
// `max_blocks` (the kernels then loop), and {0, 0} for no items.
LaunchShape GridFor(size_t items, unsigned threads_per_block = kThreadsPerBlock,
                    unsigned max_blocks = kMaxBlocks);

// Work items of the vectorised element-wise kernels: each item is `per_item`
// consecutive elements (the last one may be short): ceil(count / per_item).
constexpr size_t ItemsFor(size_t count, size_t per_item) {
  return count / per_item + (count % per_item != 0 ? 1 : 0);
}

// The status for a CUDA runtime error code (an int, so that callers need not
// include cuda_runtime.h): OK for 0; FAILED_PRECONDITION "no CUDA device:
// <reason>" for the errors that mean no usable device or driver; INTERNAL
// naming `what` and CUDA's message for anything else.
absl::Status CudaStatus(int error, absl::string_view what);

}  // namespace ciuic::daemon::gpu
