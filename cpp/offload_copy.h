// Offload's copies, one Python call each: see offload_copy.cpp.
#pragma once

#include <torch/extension.h>

#include <cuda_runtime_api.h>

namespace stweaver_offload {

// A CUDA event from a process-wide pool, given back when destroyed.
class PooledEvent {
 public:
  PooledEvent(int device, bool timing);
  ~PooledEvent();
  PooledEvent(const PooledEvent&) = delete;
  PooledEvent& operator=(const PooledEvent&) = delete;

  // Whether the work recorded before it has completed (cudaEventQuery).
  bool query() const;
  // Milliseconds from this event to `end` (both timing events, both completed).
  double elapsed_time(const PooledEvent& end) const;
  cudaEvent_t event() const {
    return event_;
  }

 private:
  int device_;
  bool timing_;
  cudaEvent_t event_;
};

// nbytes of page-locked host memory (Rust's fast pin) as a uint8 CPU tensor that frees it.
at::Tensor pin_host(int64_t nbytes, int64_t device);

// Adds pin_host, PooledEvent, offload_copy_out, offload_copy_in and offload_wait to the module.
void register_offload_copy(pybind11::module& m);

}  // namespace stweaver_offload
