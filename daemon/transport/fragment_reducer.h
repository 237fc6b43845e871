// Folds a message that arrives in byte ranges into a destination (the work
// behind Transport::RecvReduce): dest[i] = op(received[i], local[i]), or
// op(local[i], received[i]), element by element, with ciuic::reduce's
// kernels, as soon as each element's bytes are in.
//
// Ranges may come in any order and at any byte boundary (a transport's
// fragments need not respect element boundaries, nor alignment: the kernels
// read inputs at any address). The bytes of an element split across ranges
// wait in a side table until they are all in.
//
// Thread-safety: none; one thread consumes at a time (a UCX channel's).
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>

#include "transport/transport.h"

namespace ciuic::daemon {

class FragmentReducer {
 public:
  // `bytes`: the whole message, a multiple of the element size.
  FragmentReducer(const ReduceInto& into, size_t bytes);

  // Folds received bytes [offset, offset + length). False, with nothing
  // written, if the range reaches past the message.
  bool Consume(size_t offset, const void* data, size_t length);

  size_t bytes() const { return bytes_; }
  size_t consumed() const { return consumed_; }  // bytes folded or waiting so far
  // Every byte consumed and every element folded.
  bool complete() const { return consumed_ == bytes_ && partial_.empty(); }

 private:
  struct Partial {
    uint8_t bytes[8];
    size_t have = 0;
  };

  // A piece of one element: [pos, pos + n) within element pos / elem_.
  void Piece(size_t pos, const uint8_t* src, size_t n);
  // Folds `count` whole elements starting at element `first` from `src`.
  void Fold(size_t first, const void* src, size_t count);

  ReduceInto into_;
  size_t bytes_;
  size_t elem_;
  size_t consumed_ = 0;
  std::unordered_map<size_t, Partial> partial_;
};

}  // namespace ciuic::daemon
