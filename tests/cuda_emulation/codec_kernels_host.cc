// daemon/cuda/codec_kernels.cu built with the host compiler: its kernels run
// on the CUDA emulation's SIMT executor (simt.h), thread by thread.
// simt.h first: it defines the kernels' dialect.
// clang-format off
#include "simt.h"
#include "cuda/codec_kernels.cu"
// clang-format on
