#include "transport/fragment_reducer.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "reduce/reduce.h"

namespace ciuic::daemon {

FragmentReducer::FragmentReducer(const ReduceInto& into, size_t bytes)
    : into_(into), bytes_(bytes), elem_(wire::DataTypeSize(static_cast<uint32_t>(into.dtype))) {
  if (elem_ == 0) elem_ = 1;  // unknown dtype: callers check CheckReducible first
}

bool FragmentReducer::Consume(size_t offset, const void* data, size_t length) {
  if (offset > bytes_ || length > bytes_ - offset) return false;
  const auto* src = static_cast<const uint8_t*>(data);
  size_t pos = offset;
  const size_t end = offset + length;
  if (pos < end && pos % elem_ != 0) {  // the tail of an element begun elsewhere
    const size_t n = std::min(elem_ - pos % elem_, end - pos);
    Piece(pos, src, n);
    pos += n;
    src += n;
  }
  if (const size_t whole = (end - pos) / elem_; whole > 0) {
    Fold(pos / elem_, src, whole);
    pos += whole * elem_;
    src += whole * elem_;
  }
  if (pos < end) Piece(pos, src, end - pos);  // the head of an element that ends elsewhere
  consumed_ += length;
  return true;
}

void FragmentReducer::Piece(size_t pos, const uint8_t* src, size_t n) {
  const size_t element = pos / elem_;
  Partial& p = partial_[element];
  std::memcpy(p.bytes + pos % elem_, src, n);
  p.have += n;
  if (p.have >= elem_) {
    Fold(element, p.bytes, 1);
    partial_.erase(element);
  }
}

void FragmentReducer::Fold(size_t first, const void* src, size_t count) {
  const size_t at = first * elem_;
  const void* local = static_cast<const uint8_t*>(into_.local) + at;
  const void* inputs[2] = {src, local};
  if (!into_.received_first) std::swap(inputs[0], inputs[1]);
  reduce::Reduce(into_.dtype, into_.op, inputs, 2, static_cast<uint8_t*>(into_.dest) + at, count);
}

}  // namespace ciuic::daemon
