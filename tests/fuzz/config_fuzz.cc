// Fuzz target: what an operator types, which must give a clear error and
// never a crash: ciuicd's config file (daemon/config/config.h), a live
// tuning change (`ciuicctl tune set KEY VALUE`) and the byte sizes both
// take.
//
// Input: text, or a mode byte (1 or 2) then text. Mode "config file" (the
// first byte is anything else, so a config file is an input as it is): the
// text is the YAML document; a refusal is INVALID_ARGUMENT whose message begins with the
// file's name (config.h's promise: "FILE:LINE: " or "FILE: "). Mode
// "tuning": a key (one of TuningKeys() picked by a byte, or the text up to
// the first newline) and a value (the rest); a refused value leaves every
// setting as it was; an accepted one reads back in a canonical form that is
// accepted again and gives the same settings. Mode "byte size": an
// accepted size formats (FormatByteSize) into text that parses back to it.
#include <cstdint>
#include <string>

#include "config/config.h"
#include "config/tuning.h"
#include "config/values.h"
#include "fuzz_input.h"

namespace {

constexpr const char* kTarget = "config_fuzz";

namespace config = ciuic::config;

std::string Entries(const config::Tuning& t) {
  auto entries = config::GetTuningEntries(t, "");
  FUZZ_CHECK(entries.ok(), "GetTuningEntries of every key fails");
  std::string out;
  for (const auto& e : *entries) out += e.key + "=" + e.value + "\n";
  return out;
}

void CheckConfig(const std::string& text) {
  auto parsed = config::ParseConfigYaml(text, "fuzz.yaml");
  if (parsed.ok()) return;
  FUZZ_CHECK(parsed.status().code() == absl::StatusCode::kInvalidArgument,
             "a config refused with another code than INVALID_ARGUMENT");
  FUZZ_CHECK(parsed.status().message().rfind("fuzz.yaml:", 0) == 0,
             "a config error that does not begin with the file's name");
}

void CheckTuning(ciuic::fuzz::Input& input) {
  const auto& keys = config::TuningKeys();
  const uint8_t pick = input.Byte();
  std::string rest(reinterpret_cast<const char*>(input.rest()), input.rest_size());
  std::string key, value;
  if (pick < 224) {
    key = keys[pick % keys.size()];
    value = rest;
  } else {  // a key of the input's own: a typo, garbage, an empty one
    const size_t nl = rest.find('\n');
    key = rest.substr(0, nl);
    value = nl == std::string::npos ? "" : rest.substr(nl + 1);
  }
  config::Tuning tuning;
  const std::string before = Entries(tuning);
  const absl::Status s = config::SetTuningValue(tuning, key, value);
  if (!s.ok()) {
    FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument,
               "a tuning value refused with another code than INVALID_ARGUMENT");
    FUZZ_CHECK(!s.message().empty(), "a tuning refusal without a message");
    FUZZ_CHECK(Entries(tuning) == before, "a refused tuning value changed a setting");
    return;
  }
  FUZZ_CHECK(config::IsTuningKey(key), "a value accepted for an unknown key");
  auto entry = config::GetTuningEntries(tuning, key);
  FUZZ_CHECK(entry.ok() && entry->size() == 1, "an accepted key does not read back");
  config::Tuning again;
  FUZZ_CHECK(config::SetTuningValue(again, key, (*entry)[0].value).ok(),
             "a setting's canonical form is refused");
  FUZZ_CHECK(Entries(again) == Entries(tuning), "a setting's canonical form means another value");
}

void CheckByteSize(const std::string& text) {
  auto size = config::ParseByteSize(text);
  if (!size.ok()) {
    FUZZ_CHECK(size.status().code() == absl::StatusCode::kInvalidArgument,
               "a byte size refused with another code than INVALID_ARGUMENT");
    return;
  }
  auto back = config::ParseByteSize(config::FormatByteSize(*size));
  FUZZ_CHECK(back.ok() && *back == *size, "FormatByteSize does not parse back to the size");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ciuic::fuzz::Input input(data, size);
  const uint8_t mode = size > 0 && (data[0] == 1 || data[0] == 2) ? input.Byte() : 0;
  if (mode == 1) {
    CheckTuning(input);
    return 0;
  }
  const std::string text(reinterpret_cast<const char*>(input.rest()), input.rest_size());
  if (mode == 0) {
    CheckConfig(text);
  } else {
    CheckByteSize(text);
  }
  return 0;
}
