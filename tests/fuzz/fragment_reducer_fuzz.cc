// Fuzz target: FragmentReducer (transport/fragment_reducer.h), which folds
// a message arriving in byte ranges of any size, order and alignment into
// its destination.
//
// Input: dtype, reduce op, operand order, in place or not, element count,
// then cut points and a delivery order for the message's ranges, and a
// range past the message to offer at some point. Every dtype × op pair
// Reduce takes; the received and local elements are the input's bytes
// (any bits). After every range is consumed the reducer is complete and
// the destination is Reduce over the whole message at once, bit for bit
// (a NaN for a NaN: IsNan);
// the range past the message is refused and changes nothing.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "fuzz_input.h"
#include "reduce/reduce.h"
#include "transport/fragment_reducer.h"

namespace {

constexpr const char* kTarget = "fragment_reducer_fuzz";
namespace wire = ciuic::wire;

// A NaN's sign and payload are not part of the result: Reduce's vector and
// scalar paths may give different ones (seen: float16 prod of two NaNs,
// 0x7e00 whole and 0xfe00 folded element by element).
bool IsNan(wire::DataType dtype, const uint8_t* p) {
  switch (dtype) {
    case wire::DataType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f != f;
    }
    case wire::DataType::kFloat64: {
      double d;
      std::memcpy(&d, p, 8);
      return d != d;
    }
    case wire::DataType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
    }
    case wire::DataType::kBFloat16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return (b & 0x7f80) == 0x7f80 && (b & 0x7f) != 0;
    }
    default:
      return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ciuic::fuzz::Input in(data, size);
  ciuic::daemon::ReduceInto into;
  into.dtype = wire::kAllDataTypes[in.Byte() % 8];
  into.op = wire::kAllReduceOps[in.Byte() % 5];
  const uint8_t flags = in.Byte();
  into.received_first = (flags & 1) != 0;
  const bool in_place = (flags & 2) != 0;
  if (!ciuic::reduce::CheckReducible(into.dtype, into.op).ok()) return 0;
  const size_t es = wire::DataTypeSize(static_cast<uint32_t>(into.dtype));
  const size_t count = in.U16() % 1025;
  const size_t bytes = count * es;

  // Up to 32 cut points, then the order the ranges arrive in.
  const size_t cuts_wanted = in.Byte() % 33;
  std::vector<size_t> cuts = {0, bytes};
  for (size_t i = 0; i < cuts_wanted; ++i) cuts.push_back(bytes == 0 ? 0 : in.U16() % (bytes + 1));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<std::pair<size_t, size_t>> ranges;  // [begin, end)
  for (size_t i = 0; i + 1 < cuts.size(); ++i) ranges.push_back({cuts[i], cuts[i + 1]});
  for (size_t i = ranges.size(); i > 1; --i) std::swap(ranges[i - 1], ranges[in.Byte() % i]);
  const size_t bad_at = in.Byte() % (ranges.size() + 1);  // when the bad range comes
  const size_t bad_offset = in.U16() % (bytes + 2);
  const size_t bad_length = bytes - std::min(bytes, bad_offset) + 1 + in.Byte();

  std::vector<uint8_t> received(bytes), local(bytes);
  in.Bytes(received.data(), bytes);
  in.Bytes(local.data(), bytes);
  std::vector<uint8_t> dest = in_place ? local : std::vector<uint8_t>(bytes, 0xA5);
  into.dest = dest.data();
  into.local = in_place ? static_cast<const void*>(dest.data()) : local.data();

  std::vector<uint8_t> want(bytes);
  if (count > 0) {
    const void* inputs[2] = {received.data(), local.data()};
    if (!into.received_first) std::swap(inputs[0], inputs[1]);
    ciuic::reduce::Reduce(into.dtype, into.op, inputs, 2, want.data(), count);
  }

  ciuic::daemon::FragmentReducer reducer(into, bytes);
  for (size_t i = 0; i <= ranges.size(); ++i) {
    if (i == bad_at) {
      const std::vector<uint8_t> before = dest;
      std::vector<uint8_t> junk(bad_length, 0x5A);
      FUZZ_CHECK(!reducer.Consume(bad_offset, junk.data(), bad_length),
                 "a range past the message accepted");
      FUZZ_CHECK(dest == before, "a refused range wrote the destination");
    }
    if (i == ranges.size()) break;
    const auto [b, e] = ranges[i];
    FUZZ_CHECK(reducer.Consume(b, received.data() + b, e - b),
               "a range inside the message refused");
  }
  FUZZ_CHECK(reducer.complete(), "every range consumed but the reducer not complete");
  FUZZ_CHECK(reducer.consumed() == bytes, "consumed bytes not the message's");
  for (size_t el = 0; el < count; ++el) {
    const uint8_t* got = dest.data() + el * es;
    const uint8_t* ref = want.data() + el * es;
    if (std::memcmp(got, ref, es) == 0 || (IsNan(into.dtype, got) && IsNan(into.dtype, ref))) {
      continue;
    }
    auto hex = [&](const std::vector<uint8_t>& v) {
      uint64_t x = 0;
      std::memcpy(&x, v.data() + el * es, es);
      return static_cast<unsigned long long>(x);
    };
    std::fprintf(
        stderr, "element %zu of %zu: folded 0x%llx, whole 0x%llx (received 0x%llx, local 0x%llx)\n",
        el, count, hex(dest), hex(want), hex(received), hex(local));
    FUZZ_CHECK(false, "the folded message is not Reduce over the whole of it");
  }
  return 0;
}
