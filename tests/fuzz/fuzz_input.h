// What the fuzz targets share: reading a fuzzer's bytes as fields, and
// failing loudly when a property breaks.
//
// A target's input is a few fields read from the front (Byte, U16, U64:
// missing bytes read as zero, so every input is a valid one) and the rest
// as a payload (Rest). A broken property aborts with a message naming it:
// libFuzzer then keeps the input as a crash, and the replay driver
// (replay_main.cc) reports the input that broke it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ciuic::fuzz {

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  uint8_t Byte() {
    if (pos_ >= size_) return 0;
    return data_[pos_++];
  }
  uint16_t U16() { return static_cast<uint16_t>(Byte() | (Byte() << 8)); }
  uint32_t U32() { return static_cast<uint32_t>(U16()) | (static_cast<uint32_t>(U16()) << 16); }
  uint64_t U64() { return static_cast<uint64_t>(U32()) | (static_cast<uint64_t>(U32()) << 32); }
  // Up to `n` bytes into `out` (zeros past the end of the input).
  void Bytes(void* out, size_t n) {
    auto* o = static_cast<uint8_t*>(out);
    for (size_t i = 0; i < n; ++i) o[i] = Byte();
  }
  // Everything not read yet.
  const uint8_t* rest() const { return data_ + pos_; }
  size_t rest_size() const { return size_ - pos_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// Stops the process, naming the property that broke.
[[noreturn]] inline void Broken(const char* target, const char* what) {
  std::fprintf(stderr, "%s: property broken: %s\n", target, what);
  std::fflush(stderr);
  std::abort();
}

}  // namespace ciuic::fuzz

// Checks a property; on failure aborts naming it (and the target, kTarget,
// which each target defines).
#define FUZZ_CHECK(cond, what)                                    \
  do {                                                            \
    if (!(cond)) ::ciuic::fuzz::Broken(kTarget, #cond ": " what); \
  } while (0)
