#include "config/tuning.h"

#include <functional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "compression/codec.h"
#include "config/values.h"

namespace ciuic::config {
namespace {

constexpr std::pair<Algorithm, absl::string_view> kAlgorithmNames[] = {
    {Algorithm::kAuto, "auto"},
    {Algorithm::kRing, "ring"},
    {Algorithm::kHalvingDoubling, "halving_doubling"},
    {Algorithm::kRack, "rack"},
};

// One row of the key table: everything needed to parse, validate and show a
// key. Adding a tunable is adding one row in Table().
struct Field {
  std::string key;
  std::string description;
  // Parses and validates `value` into `tuning`; on error returns the
  // explanation of what is allowed (the caller adds key and value).
  std::function<absl::Status(absl::string_view value, Tuning& tuning)> parse;
  std::function<std::string(const Tuning&)> format;
};

absl::Status BadValue(absl::string_view key, absl::string_view value, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("invalid value '", value, "' for '", key, "': ", why));
}

Field SizeField(std::string key, absl::string_view what, uint64_t Tuning::*member, uint64_t min,
                uint64_t max) {
  std::string range = absl::StrCat(FormatByteSize(min), "..", FormatByteSize(max));
  Field field;
  field.description = absl::StrCat(what, " [bytes, suffix K/M/G; ", range, "; default ",
                                   FormatByteSize(Tuning{}.*member), "]");
  field.parse = [key, member, min, max, range](absl::string_view value, Tuning& tuning) {
    absl::StatusOr<uint64_t> bytes = ParseByteSize(value);
    if (!bytes.ok()) {
      return BadValue(key, value,
                      absl::StrCat(bytes.status().message(), "; expected a size in ", range));
    }
    if (*bytes < min || *bytes > max) {
      return BadValue(key, value, absl::StrCat("out of range; expected a size in ", range));
    }
    tuning.*member = *bytes;
    return absl::OkStatus();
  };
  field.format = [member](const Tuning& tuning) { return FormatByteSize(tuning.*member); };
  field.key = std::move(key);
  return field;
}

Field IntegerField(std::string key, absl::string_view what, absl::string_view unit,
                   uint32_t Tuning::*member, uint32_t min, uint32_t max) {
  std::string range = absl::StrCat(min, "..", max);
  Field field;
  field.description = absl::StrCat(what, " [", unit, unit.empty() ? "" : "; ", range, "; default ",
                                   Tuning{}.*member, "]");
  field.parse = [key, member, min, max, range](absl::string_view value, Tuning& tuning) {
    absl::StatusOr<uint64_t> number = ParseUnsigned(value);
    if (!number.ok()) {
      return BadValue(key, value,
                      absl::StrCat(number.status().message(), "; expected an integer in ", range));
    }
    if (*number < min || *number > max) {
      return BadValue(key, value, absl::StrCat("out of range; expected an integer in ", range));
    }
    tuning.*member = static_cast<uint32_t>(*number);
    return absl::OkStatus();
  };
  field.format = [member](const Tuning& tuning) { return absl::StrCat(tuning.*member); };
  field.key = std::move(key);
  return field;
}

Field AlgorithmField(std::string key, absl::string_view what) {
  std::vector<absl::string_view> names;
  for (const auto& [algorithm, name] : kAlgorithmNames) names.push_back(name);
  std::string allowed = absl::StrJoin(names, ", ");
  Field field;
  field.description = absl::StrCat(what, " [", absl::StrJoin(names, "|"), "; default ",
                                   AlgorithmName(Tuning{}.algorithm), "]");
  field.parse = [key, allowed](absl::string_view value, Tuning& tuning) {
    std::string normalized =
        absl::AsciiStrToLower(absl::StrReplaceAll(absl::StripAsciiWhitespace(value), {{"-", "_"}}));
    for (const auto& [algorithm, name] : kAlgorithmNames) {
      if (normalized == name) {
        tuning.algorithm = algorithm;
        return absl::OkStatus();
      }
    }
    if (normalized == "tree") {
      return BadValue(key, value,
                      absl::StrCat("there is no tree allreduce (halving_doubling takes log2 N "
                                   "rounds, a tree 2 log2 N; ring moves the fewest bytes); "
                                   "expected one of ",
                                   allowed));
    }
    return BadValue(key, value, absl::StrCat("expected one of ", allowed));
  };
  field.format = [](const Tuning& tuning) { return std::string(AlgorithmName(tuning.algorithm)); };
  field.key = std::move(key);
  return field;
}

Field BoolField(std::string key, absl::string_view what, bool Tuning::*member) {
  Field field;
  field.description = absl::StrCat(what, " [on|off; default ", Tuning{}.*member ? "on" : "off", "]");
  field.parse = [key, member](absl::string_view value, Tuning& tuning) {
    std::string v = absl::AsciiStrToLower(absl::StripAsciiWhitespace(value));
    if (v == "on" || v == "true" || v == "1" || v == "yes") {
      tuning.*member = true;
    } else if (v == "off" || v == "false" || v == "0" || v == "no") {
      tuning.*member = false;
    } else {
      return BadValue(key, value, "expected on or off");
    }
    return absl::OkStatus();
  };
  field.format = [member](const Tuning& tuning) { return std::string(tuning.*member ? "on" : "off"); };
  field.key = std::move(key);
  return field;
}

Field CodecField(std::string key, absl::string_view what) {
  Field field;
  field.description =
      absl::StrCat(what, " [none|fp16|bf16|int8|topk:RATIO; default ", Tuning{}.compression, "]");
  field.parse = [key](absl::string_view value, Tuning& tuning) {
    absl::StatusOr<daemon::CodecSpec> spec = daemon::ParseCodec(value);
    if (!spec.ok()) return BadValue(key, value, spec.status().message());
    tuning.compression = daemon::CodecName(*spec);
    return absl::OkStatus();
  };
  field.format = [](const Tuning& tuning) { return tuning.compression; };
  field.key = std::move(key);
  return field;
}

// The key table, in listing order.
const std::vector<Field>& Table() {
  static const std::vector<Field>* const table = new std::vector<Field>{
      SizeField("chunk_bytes", "Unit of work the engine splits large operations into",
                &Tuning::chunk_bytes, 4 * kKiB, kGiB),
      SizeField("small_op_bytes",
                "Operations at most this big run inline on the engine thread instead of the "
                "worker pool",
                &Tuning::small_op_bytes, 0, kGiB),
      IntegerField("spin_us", "How long the engine polls for more work before sleeping",
                   "microseconds", &Tuning::spin_us, 0, 100000),
      IntegerField("op_timeout_ms", "How long an operation waits for all ranks", "milliseconds",
                   &Tuning::op_timeout_ms, 100, 86400000),
      IntegerField("channels", "UCX workers for the inter-node phase", "", &Tuning::channels, 1,
                   64),
      IntegerField("chunks_in_flight",
                   "Chunks of a multi-node run in flight per direction and channel (enough to "
                   "keep a link busy through the rendezvous handshakes)",
                   "", &Tuning::chunks_in_flight, 1, 64),
      AlgorithmField("algorithm", "Inter-node collective algorithm"),
      CodecField("compression",
                 "Codec for inter-node traffic of float sum/avg operations (per operation: "
                 "OpOptions::compression)"),
      SizeField("min_compress_bytes", "Operations smaller than this are not compressed",
                &Tuning::min_compress_bytes, 0, kGiB),
      BoolField("error_feedback",
                "Add what compression dropped to the next operation of the same name",
                &Tuning::error_feedback),
      BoolField("compression_strict",
                "Fail operations the codec cannot take (integer dtypes, min/max/prod) instead of "
                "sending them uncompressed",
                &Tuning::compression_strict),
      SizeField("fast_path_bytes",
                "Single-node jobs run operations up to this payload per rank among their "
                "trainers, without the daemon (0 = off; fixed per job when it forms)",
                &Tuning::fast_path_bytes, 0, 256 * kKiB),
      SizeField("fusion_threshold_bytes",
                "Ready allreduces queued behind running ones are fused into one inter-node "
                "allreduce of at most this size (0: no fusion; the coordinator's setting decides "
                "for the job)",
                &Tuning::fusion_threshold_bytes, 0, kGiB),
      IntegerField("cycle_time_us",
                   "How long the coordinator holds an operation that could start at once, to "
                   "fuse and order it with others (0: never wait)",
                   "microseconds", &Tuning::cycle_time_us, 0, 1000000),
      SizeField("direct_max_bytes",
                "Allreduces and barriers up to this payload run between the nodes without the "
                "coordinator (unnamed ones always, named ones from their name's second "
                "occurrence), never compressed (0 = off; the coordinator's setting "
                "when the job forms decides for the job, at most 128K on node counts that are not a "
                "power of two)",
                &Tuning::direct_max_bytes, 0, kMiB),
      SizeField("staging_segment_bytes",
                "Multi-node operations on GPU buffers cross the network in pieces of this size, "
                "staged through host memory while the previous piece travels (the coordinator's "
                "setting decides for the job)",
                &Tuning::staging_segment_bytes, 4 * kKiB, kGiB),
      IntegerField("trace_ops",
                   "How many of its last operations the daemon keeps a record of for "
                   "`ciuicctl trace` (0: none)",
                   "", &Tuning::trace_ops, 0, 100000),
      IntegerField("heartbeat_interval_ms",
                   "How often the daemons of a multi-node job tell each other on its ordering "
                   "stream that they are alive",
                   "milliseconds", &Tuning::heartbeat_interval_ms, 100, 60000),
      IntegerField("heartbeat_misses",
                   "Intervals of silence after which a node or coordinator is taken for stopped "
                   "and its jobs end (UNAVAILABLE naming it)",
                   "", &Tuning::heartbeat_misses, 2, 100),
  };
  return *table;
}

const Field* FindField(absl::string_view key) {
  for (const Field& field : Table()) {
    if (field.key == key) return &field;
  }
  return nullptr;
}

absl::Status UnknownKey(absl::string_view key) {
  return absl::InvalidArgumentError(
      absl::StrCat("unknown tuning key '", key, "'", DidYouMean(key, TuningKeys())));
}

}  // namespace

absl::string_view AlgorithmName(Algorithm algorithm) {
  for (const auto& [value, name] : kAlgorithmNames) {
    if (value == algorithm) return name;
  }
  return "unknown";
}

const std::vector<std::string>& TuningKeys() {
  static const std::vector<std::string>* const keys = [] {
    auto* keys = new std::vector<std::string>;
    for (const Field& field : Table()) keys->push_back(field.key);
    return keys;
  }();
  return *keys;
}

bool IsTuningKey(absl::string_view key) { return FindField(key) != nullptr; }

absl::Status SetTuningValue(Tuning& tuning, absl::string_view key, absl::string_view value) {
  const Field* field = FindField(key);
  if (field == nullptr) return UnknownKey(key);
  Tuning updated = tuning;
  absl::Status status = field->parse(value, updated);
  if (status.ok()) tuning = updated;
  return status;
}

absl::StatusOr<std::vector<TuningEntry>> GetTuningEntries(const Tuning& tuning,
                                                          absl::string_view key) {
  std::vector<TuningEntry> entries;
  for (const Field& field : Table()) {
    if (key.empty() || field.key == key) {
      entries.push_back({field.key, field.format(tuning), field.description});
    }
  }
  if (entries.empty()) return UnknownKey(key);
  return entries;
}

TuningRegistry::TuningRegistry(const Tuning& initial) : tuning_(initial) {}

Tuning TuningRegistry::Snapshot() const {
  absl::MutexLock lock(&mu_);
  return tuning_;
}

void TuningRegistry::Replace(const Tuning& tuning) {
  absl::MutexLock lock(&mu_);
  tuning_ = tuning;
}

absl::Status TuningRegistry::Set(absl::string_view key, absl::string_view value) {
  absl::MutexLock lock(&mu_);
  return SetTuningValue(tuning_, key, value);
}

absl::StatusOr<std::vector<TuningEntry>> TuningRegistry::Get(absl::string_view key) const {
  Tuning snapshot = Snapshot();
  return GetTuningEntries(snapshot, key);
}

}  // namespace ciuic::config
