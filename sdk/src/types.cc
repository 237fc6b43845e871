#include <cstdlib>
#include <string>

#include "ciuic/ciuic.h"
#include "ciuic/shm_layout.h"

namespace ciuic {

static_assert(static_cast<uint32_t>(DataType::kFloat32) ==
              static_cast<uint32_t>(wire::DataType::kFloat32));
static_assert(static_cast<uint32_t>(DataType::kInt64) ==
              static_cast<uint32_t>(wire::DataType::kInt64));
static_assert(static_cast<uint32_t>(ReduceOp::kProd) ==
              static_cast<uint32_t>(wire::ReduceOp::kProd));

size_t DataTypeSize(DataType dtype) { return wire::DataTypeSize(static_cast<uint32_t>(dtype)); }

const char* DataTypeName(DataType dtype) {
  const char* n = wire::DataTypeName(static_cast<uint32_t>(dtype));
  return n ? n : "unknown";
}

const char* ReduceOpName(ReduceOp op) {
  const char* n = wire::ReduceOpName(static_cast<uint32_t>(op));
  return n ? n : "unknown";
}

bool ParseDataType(const std::string& name, DataType* out) {
  for (uint32_t v = 1; v <= 8; ++v) {
    if (name == wire::DataTypeName(v)) {
      *out = static_cast<DataType>(v);
      return true;
    }
  }
  return false;
}

bool ParseReduceOp(const std::string& name, ReduceOp* out) {
  for (uint32_t v = 1; v <= 5; ++v) {
    if (name == wire::ReduceOpName(v)) {
      *out = static_cast<ReduceOp>(v);
      return true;
    }
  }
  return false;
}

std::string DefaultSocketPath() {
  const char* env = std::getenv("CIUIC_SOCKET");
  if (env != nullptr && env[0] != '\0') return env;
  return "/run/ciuic/ciuicd.sock";
}

}  // namespace ciuic
