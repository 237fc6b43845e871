// FragmentReducer must give exactly what one ciuic::reduce::Reduce over the
// whole message gives (bit for bit, but for NaN payloads, see SameElement; the kernels themselves are checked
// against plain loops in proto/reduce/reduce_test.cc), however the message
// is cut into fragments, in whatever order they come and from whatever
// addresses: every dtype and reduce op, operand order, in and out of place,
// sizes 0, 1, odd and large.
#include "transport/fragment_reducer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "reduce/reduce.h"

namespace ciuic::daemon {
namespace {

using wire::DataType;
using wire::ReduceOp;

std::vector<uint8_t> RandomBytes(size_t n, std::mt19937_64& rng) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

struct Fragment {
  size_t offset;
  size_t bytes;
};

// Cuts [0, n) at `cuts` random byte positions, then shuffles the pieces.
std::vector<Fragment> Cut(size_t n, size_t cuts, std::mt19937_64& rng) {
  std::vector<size_t> at = {0, n};
  for (size_t i = 0; i < cuts && n > 1; ++i) at.push_back(1 + rng() % (n - 1));
  std::sort(at.begin(), at.end());
  at.erase(std::unique(at.begin(), at.end()), at.end());
  std::vector<Fragment> out;
  for (size_t i = 0; i + 1 < at.size(); ++i) out.push_back({at[i], at[i + 1] - at[i]});
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

// Whether element i of `a` and `b` agree: the same bits, or both NaN. When
// two NaNs meet, which payload survives depends on the operand order the
// compiler chose in the kernel's vector and scalar loops (x86 keeps the
// first operand's), so an element folded alone may keep the other one.
bool SameElement(DataType dtype, const uint8_t* a, const uint8_t* b) {
  const size_t es = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  if (std::memcmp(a, b, es) == 0) return true;
  uint64_t x = 0, y = 0;
  std::memcpy(&x, a, es);
  std::memcpy(&y, b, es);
  auto nan = [dtype](uint64_t v) {
    switch (dtype) {
      case DataType::kFloat32: return (v & 0x7f800000u) == 0x7f800000u && (v & 0x7fffffu) != 0;
      case DataType::kFloat64:
        return (v & 0x7ff0000000000000u) == 0x7ff0000000000000u && (v & 0xfffffffffffffu) != 0;
      case DataType::kFloat16: return (v & 0x7c00u) == 0x7c00u && (v & 0x3ffu) != 0;
      case DataType::kBFloat16: return (v & 0x7f80u) == 0x7f80u && (v & 0x7fu) != 0;
      default: return false;
    }
  };
  return nan(x) && nan(y);
}

// Runs one case: the message `received` folded into `local` by fragments
// (each copied to a source address `misalign` bytes off alignment, as a
// transport's receive buffer may hold it), against one whole Reduce.
void Check(DataType dtype, ReduceOp op, size_t count, bool received_first, bool in_place,
           const std::vector<Fragment>& fragments, size_t misalign, std::mt19937_64& rng) {
  const size_t es = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  const size_t n = count * es;
  const std::vector<uint8_t> received = RandomBytes(n, rng);
  const std::vector<uint8_t> local = RandomBytes(n, rng);

  std::vector<uint8_t> expected(n);
  const void* inputs[2] = {received.data(), local.data()};
  if (!received_first) std::swap(inputs[0], inputs[1]);
  reduce::Reduce(dtype, op, inputs, 2, expected.data(), count);

  std::vector<uint8_t> dest = in_place ? local : std::vector<uint8_t>(n, 0xAB);
  std::vector<uint8_t> local_copy = local;
  ReduceInto into;
  into.dtype = dtype;
  into.op = op;
  into.received_first = received_first;
  into.dest = dest.data();
  into.local = in_place ? static_cast<const void*>(dest.data()) : local_copy.data();
  FragmentReducer fr(into, n);
  std::vector<uint64_t> staging((n + 16) / 8 + 2);
  size_t total = 0;
  for (const Fragment& f : fragments) {
    EXPECT_FALSE(fr.complete());
    auto* src = reinterpret_cast<uint8_t*>(staging.data()) + misalign;
    std::memcpy(src, received.data() + f.offset, f.bytes);
    ASSERT_TRUE(fr.Consume(f.offset, src, f.bytes));
    total += f.bytes;
    EXPECT_EQ(fr.consumed(), total);
  }
  EXPECT_TRUE(fr.complete());
  for (size_t i = 0; i < count; ++i) {
    ASSERT_TRUE(SameElement(dtype, dest.data() + i * es, expected.data() + i * es))
        << wire::DataTypeName(static_cast<uint32_t>(dtype)) << " op " << static_cast<int>(op)
        << " count " << count << " element " << i << " fragments " << fragments.size()
        << " misalign " << misalign;
  }
  if (!in_place) {
    EXPECT_EQ(local_copy, local);  // the local operand is only read
  }
}

TEST(FragmentReducerTest, EveryTypeOpAndCutMatchesOneWholeReduce) {
  std::mt19937_64 rng(7);
  for (DataType dtype : wire::kAllDataTypes) {
    for (ReduceOp op : wire::kAllReduceOps) {
      for (size_t count : {size_t{1}, size_t{7}, size_t{1000}, size_t{4099}}) {
        const size_t n = count * wire::DataTypeSize(static_cast<uint32_t>(dtype));
        for (bool received_first : {true, false}) {
          for (bool in_place : {true, false}) {
            Check(dtype, op, count, received_first, in_place, {{0, n}}, 0, rng);
            Check(dtype, op, count, received_first, in_place, Cut(n, 5, rng), 0, rng);
            Check(dtype, op, count, received_first, in_place, Cut(n, 40, rng), 3, rng);
          }
        }
      }
    }
  }
}

TEST(FragmentReducerTest, OneByteFragmentsInReverseOrder) {
  std::mt19937_64 rng(11);
  for (DataType dtype : {DataType::kFloat64, DataType::kFloat16, DataType::kInt32}) {
    const size_t n = 33 * wire::DataTypeSize(static_cast<uint32_t>(dtype));
    std::vector<Fragment> bytes;
    for (size_t i = n; i-- > 0;) bytes.push_back({i, 1});
    Check(dtype, ReduceOp::kSum, 33, true, false, bytes, 1, rng);
  }
}

TEST(FragmentReducerTest, EveryMisalignmentOfTheSource) {
  std::mt19937_64 rng(13);
  for (size_t misalign = 0; misalign < 8; ++misalign) {
    for (DataType dtype : wire::kAllDataTypes) {
      // Large enough for the kernel's vector loop.
      const size_t count = 100003;
      const size_t n = count * wire::DataTypeSize(static_cast<uint32_t>(dtype));
      Check(dtype, ReduceOp::kSum, count, true, true, Cut(n, 3, rng), misalign, rng);
    }
  }
}

TEST(FragmentReducerTest, EmptyMessageIsCompleteAtOnce) {
  int dest = 5;
  ReduceInto into;
  into.dtype = DataType::kInt32;
  into.dest = &dest;
  into.local = &dest;
  FragmentReducer fr(into, 0);
  EXPECT_TRUE(fr.complete());
  EXPECT_TRUE(fr.Consume(0, nullptr, 0));
  EXPECT_EQ(dest, 5);
}

TEST(FragmentReducerTest, RangePastTheMessageIsRefusedAndWritesNothing) {
  std::vector<int32_t> dest = {1, 2, 3, 4};
  const std::vector<int32_t> before = dest;
  ReduceInto into;
  into.dtype = DataType::kInt32;
  into.op = ReduceOp::kSum;
  into.dest = dest.data();
  into.local = dest.data();
  FragmentReducer fr(into, 16);
  const int32_t extra[4] = {10, 10, 10, 10};
  EXPECT_FALSE(fr.Consume(8, extra, 12));
  EXPECT_FALSE(fr.Consume(17, extra, 0));
  EXPECT_EQ(dest, before);
  EXPECT_EQ(fr.consumed(), 0u);
  // A message cut short leaves the reducer incomplete (the transport's
  // size-mismatch error).
  EXPECT_TRUE(fr.Consume(0, extra, 6));
  EXPECT_FALSE(fr.complete());
  EXPECT_EQ(dest[0], 11);
  EXPECT_EQ(dest[1], 2);  // half an element: not folded
}

}  // namespace
}  // namespace ciuic::daemon
