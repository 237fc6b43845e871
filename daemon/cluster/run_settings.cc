#include "cluster/run_settings.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "ciuic/collective_rules.h"
#include "ciuic/shm_layout.h"
#include "compression/codec.h"
#include "reduce/reduce.h"

namespace ciuic::daemon {
namespace {

// Codecs are stateless objects: one per spec, kept for the process.
const Codec* CodecForSpec(const std::string& spec_text, absl::Status* error) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Codec>>* cache =
      new std::map<std::string, std::unique_ptr<Codec>>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(spec_text);
  if (it == cache->end()) {
    auto spec = ParseCodec(spec_text);
    if (!spec.ok()) {
      *error = spec.status();
      return nullptr;
    }
    it = cache->emplace(spec_text, MakeCodec(*spec)).first;
  }
  return it->second.get();
}

}  // namespace

absl::StatusOr<std::string> ResolveCodec(const std::string& op_name, const CodecRequest& request,
                                         const config::Tuning& tuning) {
  std::string name;
  switch (static_cast<wire::Codec>(request.codec)) {
    case wire::Codec::kDefault: name = tuning.compression; break;
    case wire::Codec::kNone: name = "none"; break;
    case wire::Codec::kFp16: name = "fp16"; break;
    case wire::Codec::kBf16: name = "bf16"; break;
    case wire::Codec::kInt8: name = "int8"; break;
    case wire::Codec::kTopK: name = absl::StrCat("topk:", request.codec_ratio); break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("operation '", op_name, "': unknown codec ", request.codec));
  }
  if (name == "none" || request.bytes < tuning.min_compress_bytes) return std::string();
  absl::Status error;
  const Codec* codec = CodecForSpec(name, &error);
  if (codec == nullptr) return error;
  const auto requested = static_cast<wire::ReduceOp>(request.reduce_op);
  const auto wire_op = wire::CombiningOp(requested);
  absl::Status supported = codec->Supports(static_cast<wire::DataType>(request.dtype));
  if (supported.ok() && wire_op != wire::ReduceOp::kSum) {
    const char* op = wire::ReduceOpName(request.reduce_op);
    supported = absl::InvalidArgumentError(
        absl::StrCat("compression applies to sum and avg, not ", op ? op : "?"));
  }
  if (!supported.ok()) {
    if (!tuning.compression_strict) return std::string();  // sent as it is
    return absl::InvalidArgumentError(absl::StrCat("operation '", op_name, "': compression ", name,
                                                   ": ", supported.message()));
  }
  return name;
}

bool FusableAllreduce(uint64_t bytes, const std::string& codec, config::Algorithm algorithm,
                      int num_nodes) {
  if (!codec.empty()) return true;
  return OffsetIndependent(num_nodes, AllreduceAlgorithmOf(algorithm, num_nodes, bytes, false));
}

uint64_t AlltoallSegments(uint64_t rank_bytes, uint64_t segment_bytes) {
  const uint64_t per = std::max<uint64_t>(1, segment_bytes);
  return std::clamp<uint64_t>(rank_bytes / per + (rank_bytes % per != 0), 1, kMaxSegments);
}

InterNodeAlgorithm InterNodeAlgorithmFor(config::Algorithm algorithm) {
  switch (algorithm) {
    case config::Algorithm::kRing: return InterNodeAlgorithm::kRing;
    case config::Algorithm::kHalvingDoubling: return InterNodeAlgorithm::kHalvingDoubling;
    case config::Algorithm::kRack: return InterNodeAlgorithm::kRack;
    case config::Algorithm::kAuto: break;
  }
  return InterNodeAlgorithm::kAuto;
}

InterNodeAlgorithm AllreduceAlgorithmOf(config::Algorithm algorithm, int num_nodes,
                                        uint64_t bytes, bool fused) {
  InterNodeAlgorithm algo = InterNodeAlgorithmFor(algorithm);
  if (algo == InterNodeAlgorithm::kAuto) algo = ChooseAllreduceAlgorithm(num_nodes, bytes);
  if (fused && !OffsetIndependent(num_nodes, algo)) algo = InterNodeAlgorithm::kHalvingDoubling;
  return algo;
}

std::string RunAlgorithmName(const RunSettings& settings, uint32_t collective, int num_nodes,
                             uint64_t bytes, bool fused) {
  const auto c = static_cast<wire::Collective>(collective);
  const bool reducing = c == wire::Collective::kAllreduce || c == wire::Collective::kReduceScatter;
  if (reducing && !settings.codec.empty()) return "compressed";
  switch (c) {
    case wire::Collective::kAllreduce: {
      const uint64_t piece =
          settings.segment_bytes > 0 ? std::min(bytes, settings.segment_bytes) : bytes;
      switch (AllreduceAlgorithmOf(settings.algorithm, num_nodes, piece, fused)) {
        case InterNodeAlgorithm::kHalvingDoubling: return "halving_doubling";
        case InterNodeAlgorithm::kRack: return "rack";
        default: return "ring";
      }
    }
    case wire::Collective::kReduceScatter:
    case wire::Collective::kAllgather:
      return settings.algorithm == config::Algorithm::kRack ? "rack" : "ring";
    case wire::Collective::kBroadcast:
      if (settings.algorithm == config::Algorithm::kRack) return "rack";
      return bytes <= std::max<uint64_t>(1, settings.chunk_bytes) ? "tree" : "chain";
    case wire::Collective::kAlltoall:
    case wire::Collective::kAlltoallv: return "pairwise";
    case wire::Collective::kBarrier: break;
  }
  return "";
}

}  // namespace ciuic::daemon
