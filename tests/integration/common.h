// Small helpers shared by the integration tests' rank functions.
#pragma once

#include <cstdio>
#include <memory>
#include <string>

#include "ciuic/ciuic.h"

namespace ciuic::testing {

inline std::unique_ptr<Communicator> JoinJob(const std::string& socket, const std::string& job,
                                             int rank, int world, uint64_t arena = 16 << 20) {
  JobOptions o;
  o.socket_path = socket;
  o.job_id = job;
  o.rank = rank;
  o.world_size = world;
  o.arena_bytes = arena;
  std::unique_ptr<Communicator> c;
  Status s = Communicator::Create(o, &c);
  if (!s.ok()) fprintf(stderr, "rank %d: Create: %s\n", rank, s.ToString().c_str());
  return c;
}

inline bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace ciuic::testing
