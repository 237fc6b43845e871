#include "config/values.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace ciuic::config {
namespace {

// Multiplies `value` by `factor`, failing on overflow.
bool CheckedMultiply(uint64_t value, uint64_t factor, uint64_t* out) {
  return !__builtin_mul_overflow(value, factor, out);
}

}  // namespace

absl::StatusOr<uint64_t> ParseUnsigned(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  if (text.empty()) return absl::InvalidArgumentError("empty value");
  uint64_t value = 0;
  for (char c : text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) {
      return absl::InvalidArgumentError("not a non-negative integer");
    }
    if (!CheckedMultiply(value, 10, &value) ||
        __builtin_add_overflow(value, static_cast<uint64_t>(c - '0'), &value)) {
      return absl::InvalidArgumentError("number too large");
    }
  }
  return value;
}

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  text = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < text.size() && absl::ascii_isdigit(static_cast<unsigned char>(text[digits]))) {
    ++digits;
  }
  if (digits == 0) {
    return absl::InvalidArgumentError("not a size (expected e.g. 4096, 64K, 4M, 1G)");
  }
  absl::StatusOr<uint64_t> number = ParseUnsigned(text.substr(0, digits));
  if (!number.ok()) return absl::InvalidArgumentError("size too large");
  absl::string_view suffix = text.substr(digits);
  uint64_t factor = 1;
  if (!suffix.empty()) {
    switch (absl::ascii_toupper(static_cast<unsigned char>(suffix[0]))) {
      case 'K':
        factor = kKiB;
        break;
      case 'M':
        factor = kMiB;
        break;
      case 'G':
        factor = kGiB;
        break;
      case 'T':
        factor = kTiB;
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("unknown size suffix '", suffix, "' (use K, M, G or T)"));
    }
    absl::string_view rest = suffix.substr(1);
    if (!rest.empty() && !absl::EqualsIgnoreCase(rest, "iB")) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown size suffix '", suffix, "' (use K, M, G or T)"));
    }
  }
  uint64_t bytes = 0;
  if (!CheckedMultiply(*number, factor, &bytes)) {
    return absl::InvalidArgumentError("size too large");
  }
  return bytes;
}

std::string FormatByteSize(uint64_t bytes) {
  if (bytes == 0) return "0";
  static constexpr struct {
    uint64_t factor;
    const char* suffix;
  } kUnits[] = {{kTiB, "T"}, {kGiB, "G"}, {kMiB, "M"}, {kKiB, "K"}};
  for (const auto& unit : kUnits) {
    if (bytes % unit.factor == 0) return absl::StrCat(bytes / unit.factor, unit.suffix);
  }
  return absl::StrCat(bytes);
}

int EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<int> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = static_cast<int>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    int diagonal = row[0];
    row[0] = static_cast<int>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      int above = row[j];
      bool same = absl::ascii_tolower(static_cast<unsigned char>(a[i - 1])) ==
                  absl::ascii_tolower(static_cast<unsigned char>(b[j - 1]));
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (same ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::optional<std::string> ClosestMatch(absl::string_view key,
                                        const std::vector<std::string>& candidates) {
  if (key.empty()) return std::nullopt;
  std::optional<std::string> best;
  int best_distance = 0;
  for (const std::string& candidate : candidates) {
    int distance = EditDistance(key, candidate);
    int allowed = std::max<int>(2, static_cast<int>(candidate.size()) / 3);
    bool prefix = key.size() >= 3 && (absl::StartsWithIgnoreCase(candidate, key) ||
                                      absl::StartsWithIgnoreCase(key, candidate));
    if (distance > allowed && !prefix) continue;
    if (!best || distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

std::string DidYouMean(absl::string_view key, const std::vector<std::string>& candidates) {
  std::optional<std::string> match = ClosestMatch(key, candidates);
  if (!match) return "";
  return absl::StrCat(" (did you mean '", *match, "'?)");
}

}  // namespace ciuic::config
