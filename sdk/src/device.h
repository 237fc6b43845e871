// The SDK's half of device buffers: describes CUDA memory to ciuicd.
//
// Describe() finds the allocation that holds a buffer (its base and size,
// through the driver API reached via the runtime, so libciuic needs no
// libcuda at link time), exports its CUDA IPC memory handle once per
// allocation and process (cached by base and the driver's unique buffer
// id, so a new allocation at a freed one's address is exported again; the
// cache is the process's, so every communicator names an allocation by the
// same handle, whose one mapping ciuicd shares between them) and fills a
// wire::DeviceBufferDescriptor. RecordEvent() records an interprocess event
// on the trainer's stream and hands out its IPC handle; the event goes back
// to a per-device pool when `hold` is released (when the operation has
// completed, so the daemon has waited on it), and is then reused.
//
// Threads: any; an internal mutex guards the caches. The caller's current
// device is restored before each call returns. Built without CUDA, every
// call fails with FAILED_PRECONDITION saying so.
#pragma once

#include <cstddef>
#include <memory>

#include "ciuic/ciuic.h"
#include "ciuic/shm_layout.h"

namespace ciuic {

class DeviceExporter {
 public:
  DeviceExporter();
  ~DeviceExporter();
  DeviceExporter(const DeviceExporter&) = delete;
  DeviceExporter& operator=(const DeviceExporter&) = delete;

  // Fills memory_handle, offset, allocation_bytes and device for the
  // `bytes` bytes at `ptr`, which must be device memory of `device`.
  Status Describe(const void* ptr, size_t bytes, int device, wire::DeviceBufferDescriptor* out);

  // Records an event on `stream` of `device` and writes its IPC handle to
  // `handle`; `*hold` keeps the event out of the pool until it is reset.
  Status RecordEvent(void* stream, int device, uint8_t* handle, std::shared_ptr<void>* hold);

  struct State;  // the CUDA side; shared with outstanding holds

 private:
  std::shared_ptr<State> state_;
};

}  // namespace ciuic
