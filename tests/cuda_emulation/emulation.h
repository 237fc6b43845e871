// The CUDA emulation's inside, for its SIMT executor (simt.h) and its CUB
// shim (include/cub): a stream
// to run work on, and what a device may touch. See README.md.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>
#include <string>

namespace ciuic::cuda_emulation {

// Enqueues `work` on `stream` (nullptr: the current device's default stream)
// as a kernel launch: it runs on the stream's thread, in stream order, and
// gets the stream's device. The launch's status: cudaSuccess, the context's
// sticky error (after a fault), or cudaErrorInvalidResourceHandle.
cudaError_t Launch(void* stream, std::function<void(int device)> work);

// Where the device `device` reads and writes `bytes` at `device_ptr`: the
// host alias of device memory it can reach (its own, a peer's with peer
// access enabled, an IPC mapping opened on it) or pinned host memory
// (cudaHostAlloc) itself. nullptr where a GPU would fault: host memory that
// is not pinned, a freed or unknown range, a range that ends early, a peer's
// memory without peer access. bytes == 0 checks nothing and gives nullptr
// only for a null pointer.
void* Access(const void* device_ptr, size_t bytes, int device);

// What work that touched memory its device cannot reach does on a GPU: the
// context breaks, and every later call of the process returns
// cudaErrorIllegalAddress. The emulation says `what` on stderr.
void Fault(const std::string& what);

namespace simt {

// The host address at which device `device`'s kernel reaches the pointer
// argument `p` (simt.h): `*known` is false for an address no emulated
// memory holds (then `p` itself is returned); nullptr with *known true
// means the memory is there but out of the device's reach. A buffer may
// start where its allocation ends.
void* TranslateArgument(const void* p, int device, bool* known);

// Whether CUDA refuses a launch of `grid` blocks of `block` threads; then
// the thread's last error is cudaErrorInvalidConfiguration.
bool BadShape(unsigned grid, unsigned block);

}  // namespace simt

}  // namespace ciuic::cuda_emulation
