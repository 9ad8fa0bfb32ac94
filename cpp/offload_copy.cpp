// Offload's copies, one Python call each (stweaver._offload's CudaBackend fast path).
//
// The offloader moves a saved activation to pinned host memory in forward and back in
// backward. Written with torch's Python API, one copy out is ~10 calls (the current
// stream, a side stream waiting for it through a new event, a stream context, copy_,
// record_stream, one or two new timing events): ~100 us of host time per tensor on the
// H100's host, paid ~120 times per GPT-2 XL iteration each way while forward is
// host-bound. Here each direction is one call: the current stream's work is ordered
// before the copy by a pooled event, the copy is one cudaMemcpyAsync of the whole
// storage (the offloader only moves a tensor that covers its storage, so the bytes are
// the same as a strided copy between two tensors of the same strides), the device
// block is recorded on the side stream (record_stream), and the completion event comes
// from the pool.
//
// Events: `PooledEvent` owns a CUDA event taken from a process-wide pool and gives it
// back when its Python object dies, so a steady run creates no events. An event
// recorded only to order one stream after another goes back at once: a stream waits
// on the record made before `cudaStreamWaitEvent`, whatever is recorded later.
// Pooled events are never destroyed (the pool outlives CUDA's teardown at exit).
//
// Pinned host buffers (`pin_host`): the offloader's pool asks for a few large ones. They
// come from the Rust side (`stweaver_cuda`'s fast pin: a huge-page mapping faulted in by
// several threads, then cudaHostRegister'ed; 16 GiB in 0.9 s where cudaHostAlloc, which
// torch's pin_memory=True uses, took 6.7-8.2 s and blocked launches from other threads
// meanwhile) and are handed to Python as a uint8 CPU tensor whose deleter gives them back.
#include "offload_copy.h"
#include "stweaver_allocator.h"

#include "rust/cxx.h"
#include "stweaver-torch/src/ffi.rs.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

namespace stweaver_offload {
namespace {

struct Pool {
  std::mutex mu;
  // (device, timing) -> free events.
  std::vector<std::tuple<int, bool, cudaEvent_t>> free;
};

Pool& pool() {
  // Never destroyed: events may be given back during interpreter teardown.
  static Pool* p = new Pool();
  return *p;
}

cudaEvent_t take(int device, bool timing) {
  {
    Pool& p = pool();
    std::lock_guard<std::mutex> g(p.mu);
    for (size_t i = p.free.size(); i-- > 0;) {
      auto [d, t, ev] = p.free[i];
      if (d == device && t == timing) {
        p.free[i] = p.free.back();
        p.free.pop_back();
        return ev;
      }
    }
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaEvent_t ev = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, timing ? cudaEventDefault : cudaEventDisableTiming));
  return ev;
}

void give_back(int device, bool timing, cudaEvent_t ev) {
  Pool& p = pool();
  std::lock_guard<std::mutex> g(p.mu);
  p.free.emplace_back(device, timing, ev);
}

// `a` (current stream) work before anything queued on `b` from now on.
void order_after(int device, cudaStream_t a, cudaStream_t b) {
  cudaEvent_t ev = take(device, false);
  C10_CUDA_CHECK(cudaEventRecord(ev, a));
  C10_CUDA_CHECK(cudaStreamWaitEvent(b, ev, 0));
  give_back(device, false, ev);
}

c10::cuda::CUDAStream side_stream(int64_t id, int64_t device_index, int64_t device_type) {
  return c10::cuda::CUDAStream::unpack3(
      static_cast<c10::StreamId>(id),
      static_cast<c10::DeviceIndex>(device_index),
      static_cast<c10::DeviceType>(device_type));
}

using Events = std::tuple<std::shared_ptr<PooledEvent>, std::shared_ptr<PooledEvent>>;

Events copy(
    const at::Tensor& device_tensor,
    const at::Tensor& host,
    int64_t nbytes,
    int64_t stream_id,
    int64_t stream_device,
    int64_t stream_type,
    const PooledEvent* after,
    bool timing,
    bool out) {
  TORCH_CHECK(device_tensor.is_cuda(), "stweaver offload: the device tensor is not a CUDA tensor");
  TORCH_CHECK(host.device().is_cpu(), "stweaver offload: the host buffer is not on the CPU");
  TORCH_CHECK(nbytes >= 0, "stweaver offload: negative size ", nbytes);
  TORCH_CHECK(
      static_cast<int64_t>(device_tensor.storage().nbytes()) >= nbytes &&
          device_tensor.data_ptr() == device_tensor.storage().data(),
      "stweaver offload: the device tensor does not start its storage or is smaller than ",
      nbytes,
      " bytes");
  TORCH_CHECK(
      host.is_contiguous() && host.numel() * static_cast<int64_t>(host.element_size()) >= nbytes,
      "stweaver offload: the host buffer holds fewer than ",
      nbytes,
      " bytes");
  const int device = device_tensor.device().index();
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  c10::cuda::CUDAStream side = side_stream(stream_id, stream_device, stream_type);
  TORCH_CHECK(side.device_index() == device, "stweaver offload: the side stream is on another device");
  cudaStream_t cur = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  order_after(device, cur, side.stream());
  if (after != nullptr) {
    C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), after->event(), 0));
  }
  std::shared_ptr<PooledEvent> start;
  if (timing) {
    start = std::make_shared<PooledEvent>(device, true);
    C10_CUDA_CHECK(cudaEventRecord(start->event(), side.stream()));
  }
  void* d = device_tensor.data_ptr();
  void* h = host.data_ptr();
  C10_CUDA_CHECK(cudaMemcpyAsync(
      out ? h : d,
      out ? d : h,
      static_cast<size_t>(nbytes),
      out ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
      side.stream()));
  // The device block is not reused (nor, copied in, freed) under the copy. Under stweaver
  // the copy is the block's only use on the side stream, so its free waits for this copy
  // alone, not for the later tensors' copies queued on the side stream by then.
  if (stweaver::StweaverAllocator* a = stweaver::installed(); a != nullptr) {  // the CUDA allocator
    a->recordStreamEnqueued(device_tensor.storage().data_ptr(), side);
  } else {
    c10::cuda::CUDACachingAllocator::recordStream(device_tensor.storage().data_ptr(), side);
  }
  auto done = std::make_shared<PooledEvent>(device, timing);
  C10_CUDA_CHECK(cudaEventRecord(done->event(), side.stream()));
  return Events(start, done);
}

}  // namespace

PooledEvent::PooledEvent(int device, bool timing)
    : device_(device), timing_(timing), event_(take(device, timing)) {}

PooledEvent::~PooledEvent() {
  give_back(device_, timing_, event_);
}

bool PooledEvent::query() const {
  cudaError_t err = cudaEventQuery(event_);
  if (err == cudaSuccess) {
    return true;
  }
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: clear it
    return false;
  }
  C10_CUDA_CHECK(err);
  return false;
}

double PooledEvent::elapsed_time(const PooledEvent& end) const {
  TORCH_CHECK(timing_ && end.timing_, "stweaver offload: elapsed_time needs two timing events");
  float ms = 0;
  C10_CUDA_CHECK(cudaEventElapsedTime(&ms, event_, end.event_));
  return ms;
}

at::Tensor pin_host(int64_t nbytes, int64_t device) {
  TORCH_CHECK(nbytes > 0, "stweaver.pin_host: nbytes must be positive, got ", nbytes);
  stweaver::ffi::PinnedBuffer* raw = nullptr;
  try {
    raw = stweaver::ffi::pin_host(static_cast<int32_t>(device), static_cast<size_t>(nbytes)).into_raw();
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "stweaver.pin_host: could not pin ", nbytes, " bytes of host memory: ", e.what());
  }
  void* ptr = reinterpret_cast<void*>(raw->ptr());
  // The storage's deleter owns the buffer from here: the Box is rebuilt and dropped there.
  return torch::from_blob(
      ptr,
      {nbytes},
      [raw](void*) { (void)rust::Box<stweaver::ffi::PinnedBuffer>::from_raw(raw); },
      at::TensorOptions().dtype(at::kByte));
}

void register_offload_copy(pybind11::module& m) {
  namespace py = pybind11;
  m.def(
      "pin_host",
      &pin_host,
      py::arg("nbytes"),
      py::arg("device"),
      py::call_guard<py::gil_scoped_release>(),
      "nbytes of page-locked host memory as a uint8 CPU tensor (freed with it); made in the device's "
      "primary context, portable. STWEAVER_PIN_THREADS: threads that fault the pages in (0: cudaHostAlloc).");
  py::class_<PooledEvent, std::shared_ptr<PooledEvent>>(
      m, "PooledEvent", "A CUDA event of the offloader's pool (back to the pool when this object dies).")
      .def("query", &PooledEvent::query, "Whether the work before the record has completed.")
      .def(
          "elapsed_time",
          &PooledEvent::elapsed_time,
          py::arg("end"),
          "Milliseconds from this (timing) event to end's.");
  m.def(
      "offload_copy_out",
      [](const at::Tensor& src, const at::Tensor& host, int64_t nbytes, int64_t stream_id, int64_t stream_device,
         int64_t stream_type, bool timing) {
        return copy(src, host, nbytes, stream_id, stream_device, stream_type, nullptr, timing, true);
      },
      py::arg("src"),
      py::arg("host"),
      py::arg("nbytes"),
      py::arg("stream_id"),
      py::arg("stream_device"),
      py::arg("stream_type"),
      py::arg("timing"),
      "Copies nbytes of src's storage into the pinned host buffer on the side stream (after the current "
      "stream's work so far), records src on it; (start event or None, done event).");
  m.def(
      "offload_copy_in",
      [](const at::Tensor& dst, const at::Tensor& host, int64_t nbytes, int64_t stream_id, int64_t stream_device,
         int64_t stream_type, const PooledEvent& after, bool timing) {
        return copy(dst, host, nbytes, stream_id, stream_device, stream_type, &after, timing, false);
      },
      py::arg("dst"),
      py::arg("host"),
      py::arg("nbytes"),
      py::arg("stream_id"),
      py::arg("stream_device"),
      py::arg("stream_type"),
      py::arg("after"),
      py::arg("timing"),
      "Copies nbytes of the pinned host buffer into dst's storage on the side stream, after the current "
      "stream's work so far and after the event `after` (the copy out); records dst on it; (start or None, done).");
  m.def(
      "offload_wait",
      [](const PooledEvent& ev, int64_t device) {
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
        cudaStream_t cur = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
        C10_CUDA_CHECK(cudaStreamWaitEvent(cur, ev.event(), 0));
      },
      py::arg("event"),
      py::arg("device"),
      "The device's current stream waits (on the device) for the event.");
}

}  // namespace stweaver_offload
