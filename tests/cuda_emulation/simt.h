// The CUDA emulation's SIMT executor: what daemon/cuda's kernel sources
// (reduce_kernels.cu, codec_kernels.cu) need to compile with the host
// compiler and run on the emulation's streams, thread by thread, as on a
// GPU. Included before a kernel source (reduce_kernels_host.cc,
// codec_kernels_host.cc); see README.md.
//
// Every GPU thread of a block is a fiber on the stream's thread. A fiber
// runs until it ends or waits at __syncthreads() or a warp shuffle; a
// barrier is released when every thread of the block (of the warp) that has
// not ended waits at it. Threads waiting at different barriers, a shuffle
// whose mask names lanes that do not take part, a bad launch shape and a
// pointer argument the device cannot reach are reported as a GPU would show
// them: a device fault (cuda_emulation::Fault) or a launch error.
//
// __shared__ variables are thread_local: the stream's thread runs one block
// at a time (so they start as zeros, or as the last block left them, where
// a GPU's start as garbage: a kernel that reads shared memory it did not
// write is not caught here). Kernel arguments that are pointers, and pointer-sized words of
// argument structs that hold device addresses, are mapped to the memory's
// host alias when the launch runs (cuda_emulation::Access's rules).
#pragma once

#include <cuda_runtime.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "emulation.h"

namespace ciuic::cuda_emulation::simt {

struct Dim {
  unsigned x = 0, y = 0, z = 0;
};

// The running GPU thread's coordinates.
const Dim& ThreadIdx();
const Dim& BlockIdx();
const Dim& BlockDim();
const Dim& GridDim();

// Waits until every thread of the block that has not ended waits here.
void SyncThreads();
// The `lane_mask` xor partner's value of the warp-wide exchange (`mask`:
// the lanes taking part, relative to the warp).
uint64_t ShuffleXor(unsigned mask, uint64_t bits, unsigned lane_mask);

// Runs `thread` for every thread of the grid on the calling thread; false
// (after a Fault) when the threads deadlock or misuse a shuffle. `kernel`
// names it in messages.
bool RunGrid(const char* kernel, unsigned grid, unsigned block,
             const std::function<void()>& thread);

// A struct that is nothing but an array of pointers named `ptr` (the
// reduction's inputs and outputs): every non-null entry is a pointer
// argument, checked as one.
template <typename T>
concept PointerArray = requires {
  T::ptr;
}
&&std::is_array_v<decltype(T::ptr)>&&
        std::is_pointer_v<std::remove_all_extents_t<decltype(T::ptr)>> &&
    sizeof(T) == sizeof(decltype(T::ptr));

template <typename P>
bool TranslatePointer(P& p, int device, const char* kernel, int index) {
  if (p == nullptr) return true;
  bool known = false;
  void* h = TranslateArgument(p, device, &known);
  if (h == nullptr || !known) {
    Fault(std::string("kernel ") + kernel + ": argument " + std::to_string(index) +
          " points at memory device " + std::to_string(device) + " cannot reach");
    return false;
  }
  p = reinterpret_cast<P>(h);
  return true;
}

template <typename T>
bool TranslateOne(T& v, int device, const char* kernel, int index) {
  if constexpr (std::is_pointer_v<T>) {
    return TranslatePointer(v, device, kernel, index);
  } else if constexpr (PointerArray<T>) {
    for (auto& p : v.ptr) {
      if (!TranslatePointer(p, device, kernel, index)) return false;
    }
  } else if constexpr (std::is_class_v<T>) {
    static_assert(std::is_trivially_copyable_v<T>, "kernel arguments are copied bytes");
    auto* bytes = reinterpret_cast<unsigned char*>(&v);
    for (size_t off = 0; alignof(T) >= alignof(void*) && off + sizeof(void*) <= sizeof(T);
         off += sizeof(void*)) {
      void* word = nullptr;
      std::memcpy(&word, bytes + off, sizeof(word));
      if (word == nullptr) continue;
      bool known = false;
      void* h = TranslateArgument(word, device, &known);
      if (!known) continue;  // not an address: a count, a flag
      if (h == nullptr) {
        Fault(std::string("kernel ") + kernel + ": argument " + std::to_string(index) +
              " holds a pointer to memory device " + std::to_string(device) + " cannot reach");
        return false;
      }
      std::memcpy(bytes + off, &h, sizeof(h));
    }
  }
  return true;
}

// kernel<<<grid, block, 0, stream>>>(args...): the arguments are converted
// to the kernel's parameter types now, as CUDA copies them at the launch.
template <typename... P>
class Launcher {
 public:
  Launcher(unsigned grid, unsigned block, cudaStream_t stream, void (*kernel)(P...),
           const char* name)
      : grid_(grid), block_(block), stream_(stream), kernel_(kernel), name_(name) {}

  template <typename... A>
  void operator()(A&&... a) const {
    static_assert(sizeof...(A) == sizeof...(P), "kernel argument count");
    if (BadShape(grid_, block_)) return;
    std::tuple<std::decay_t<P>...> args(static_cast<std::decay_t<P>>(std::forward<A>(a))...);
    Launch(stream_, [kernel = kernel_, name = name_, grid = grid_, block = block_,
                     args](int device) mutable {
      bool ok = true;
      int index = 0;
      std::apply([&](auto&... v) { ((ok = ok && TranslateOne(v, device, name, index++)), ...); },
                 args);
      if (!ok) return;
      RunGrid(name, grid, block, [&] { std::apply(kernel, args); });
    });
  }

 private:
  unsigned grid_, block_;
  cudaStream_t stream_;
  void (*kernel_)(P...);
  const char* name_;
};

template <typename... P>
Launcher<P...> MakeLauncher(unsigned grid, unsigned block, cudaStream_t stream,
                            void (*kernel)(P...), const char* name) {
  return Launcher<P...>(grid, block, stream, kernel, name);
}

template <typename T>
uint64_t ToBits(T v) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
T FromBits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

}  // namespace ciuic::cuda_emulation::simt

// The kernel sources' dialect.
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local
#define threadIdx (::ciuic::cuda_emulation::simt::ThreadIdx())
#define blockIdx (::ciuic::cuda_emulation::simt::BlockIdx())
#define blockDim (::ciuic::cuda_emulation::simt::BlockDim())
#define gridDim (::ciuic::cuda_emulation::simt::GridDim())
#define CIUIC_LAUNCH(grid, block, stream, ...) \
  ::ciuic::cuda_emulation::simt::MakeLauncher((grid), (block), (stream), __VA_ARGS__, #__VA_ARGS__)

inline void __syncthreads() { ::ciuic::cuda_emulation::simt::SyncThreads(); }

template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= 8);
  (void)width;  // the kernels exchange across whole warps
  using namespace ::ciuic::cuda_emulation::simt;
  return FromBits<T>(ShuffleXor(mask, ToBits(var), static_cast<unsigned>(lane_mask)));
}

template <typename T>
T atomicAdd(T* address, T v) {
  return __atomic_fetch_add(address, v, __ATOMIC_RELAXED);
}

template <typename T>
T atomicMin(T* address, T v) {
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (v < old &&
         !__atomic_compare_exchange_n(address, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}

inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
