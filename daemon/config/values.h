#pragma once

// Parsing and formatting of the scalar values that appear in ciuicd's config
// file and in live tuning (`ciuicctl tune set`): byte sizes with binary
// suffixes, bounded unsigned integers, and "did you mean" suggestions for
// mistyped keys. Pure functions, callable from any thread.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ciuic::config {

inline constexpr uint64_t kKiB = uint64_t{1} << 10;
inline constexpr uint64_t kMiB = uint64_t{1} << 20;
inline constexpr uint64_t kGiB = uint64_t{1} << 30;
inline constexpr uint64_t kTiB = uint64_t{1} << 40;

// Parses a byte size: a plain decimal integer ("4096") or an integer with a
// binary suffix K, M, G or T, in either case, optionally followed by "iB"
// ("4M", "4MiB", "4m" = 4194304). Surrounding blanks are ignored. Fails
// with INVALID_ARGUMENT on garbage, negative numbers or uint64 overflow; the
// message describes the problem but names no key (callers add that).
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// The canonical spelling of a size: with the largest suffix that divides it
// exactly ("4M", "1536K", "1G"), else plain bytes ("1000", "0").
std::string FormatByteSize(uint64_t bytes);

// Parses a plain non-negative decimal integer (no sign, no suffix).
absl::StatusOr<uint64_t> ParseUnsigned(absl::string_view text);

// Edit (Levenshtein) distance, case-insensitive.
int EditDistance(absl::string_view a, absl::string_view b);

// The candidate closest to `key` when it is close enough to be a plausible
// typo (small edit distance, or one is a prefix of the other); nullopt when
// nothing is close.
std::optional<std::string> ClosestMatch(absl::string_view key,
                                        const std::vector<std::string>& candidates);

// " (did you mean 'x'?)" when ClosestMatch finds one, else "".
std::string DidYouMean(absl::string_view key, const std::vector<std::string>& candidates);

}  // namespace ciuic::config
