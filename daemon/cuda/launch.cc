#include "cuda/launch.h"

#include <algorithm>
#include <string>

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace ciuic::daemon::gpu {

LaunchShape GridFor(size_t items, unsigned threads_per_block, unsigned max_blocks) {
  if (items == 0 || threads_per_block == 0 || max_blocks == 0) return {};
  const size_t blocks = ItemsFor(items, threads_per_block);
  return {static_cast<unsigned>(std::min<size_t>(blocks, max_blocks)), threads_per_block};
}

absl::Status CudaStatus(int error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  // Reported now: cleared, so that the next launch check of this thread
  // (cudaGetLastError) does not report it again (sticky errors stay).
  cudaGetLastError();
  const auto code = static_cast<cudaError_t>(error);
  const char* name = cudaGetErrorName(code);
  const char* text = cudaGetErrorString(code);
  const std::string failed = absl::StrCat(what, ": CUDA error ", name, ": ", text);
  switch (code) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemNotReady:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorNoKernelImageForDevice:
      return absl::FailedPreconditionError(
          absl::StrCat("no CUDA device: ", text, " (", name, ", in ", what, ")"));
    // A device that is there but cannot do what was asked (an ordinal out
    // of range, a feature it lacks): not "no device".
    case cudaErrorNotSupported:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(failed);
    // A device fault: the process's CUDA context is broken, every later
    // call returns the same error, whatever it is about. Said first (a
    // trainer hears the first wire::kMessageHead bytes of a long message), not
    // blamed on `what`.
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
      return absl::InternalError(
          absl::StrCat("ciuicd's CUDA context is broken by a device fault; device operations "
                       "fail until ciuicd restarts (",
                       name, ": ", text, "; seen in ", what, ")"));
    default:
      return absl::InternalError(failed);
  }
}

}  // namespace ciuic::daemon::gpu
