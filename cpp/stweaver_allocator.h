// stweaver's c10::cuda::CUDACachingAllocator::CUDAAllocator subclass.
//
// A full subclass (not CUDAPluggableAllocator), so every torch.cuda memory API keeps working.
// It holds no allocator logic: every decision is made by the Rust runtime behind the cxx
// bridge (crates/torch-bridge, header "stweaver-torch/src/ffi.rs.h"). This file converts:
// torch types to plain values and back, Rust errors to c10::Error / c10::OutOfMemoryError,
// engine history to TraceEntry (with the Python stack contexts torch hands us), and routes
// allocations of CUDA graph captures and MemPools to their private pool ids.
//
// Interface: torch 2.11 (33 pure virtuals); 2.12+ adds attachOomRejectionObserver.
//
// ---- Public API (native C++ programs; Python uses the stweaver package instead)
//
//   #include "stweaver_allocator.h"
//   stweaver::install("auto", "", "");   // first thing: before any CUDA work
//   ... train with libtorch ...
//   stweaver::installed()->runtime().step();   // once per iteration (auto / trace / plan)
//   // or step_key(k): the iteration that begins is of key k (an eval, a length bucket)
//
// - stweaver::install(mode, plan, trace): makes stweaver THE CUDA allocator of the
//   process. Settings:
//     mode   "online" (best-fit arenas over CUDA virtual memory, no plan),
//            "trace"  (online, recording every request into the trace file),
//            "plan"   (serves the plan file `plan`, made by `stweaver plan TRACE -o PLAN`;
//                      what the plan did not foresee is served online),
//            "auto"   (records the first iterations, plans them in a background thread and
//                      switches to the plan: needs step() at iteration boundaries);
//     plan   path of the .stwp plan file served in "plan" mode ("" for none);
//     trace  path of the .stwt trace file recorded in "trace" mode ("" for none; call
//            runtime().flush_trace() to write it: the Python package does so at exit).
//   The runtime also reads STWEAVER_AUTO_ITERATIONS, STWEAVER_RELEASE_AT_PEAK,
//   STWEAVER_PLAN_WAIT and STWEAVER_SHARE_STREAMS (see README.md). Throws c10::Error if CUDA
//   is already initialised, on bad settings (unknown mode, unreadable plan), or when
//   called again with different settings (the same settings again: a no-op).
// - stweaver::installed(): the installed allocator, or nullptr.
// - Stats: every torch API keeps working, e.g.
//     c10::cuda::CUDACachingAllocator::getDeviceStats(device).reserved_bytes[0].peak
//   (index 0: StatType::AGGREGATE), torch.cuda.memory_stats() from Python, memory
//   snapshots and history. stweaver's own view: installed()->runtime().info_json() (mode,
//   iterations, and per device allocated/reserved bytes and their peaks, as JSON) and
//   installed()->failed_frees().
// - installed()->runtime(): the Rust runtime (crates/torch-bridge/src/ffi.rs, cxx):
//   step() marks an iteration boundary, step_key(k) marks one where an iteration of key k
//   (any uint64_t label: an eval pass, a sequence-length bucket) begins, iteration_key(k)
//   labels the iteration in progress without a boundary (before its first allocation);
//   with a plan of several iteration classes the runtime learns each key's class and
//   guesses it first for the key's next iteration (a wrong key costs a few requests
//   served beside the plan, never an overlap; without such a plan keys change nothing).
//   mark(label, begin) opens/closes a named phase, mode() is the serving mode now,
//   flush_trace() writes the trace (trace mode). Its errors are rust::Error exceptions.
//
// Building and linking: README.md ("Native C++") and cmake/stweaverConfig.cmake; the
// example examples/cpp/train.cpp.
#pragma once

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>
#include <torch/headeronly/version.h>

#include <atomic>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "rust/cxx.h"
#include "stweaver-torch/src/ffi.rs.h"

namespace stweaver {

namespace CCA = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::TraceEntry;

class StweaverAllocator final : public CCA::CUDAAllocator {
 public:
  explicit StweaverAllocator(rust::Box<ffi::Runtime> runtime);
  ~StweaverAllocator() override = default;

  // ---- c10::Allocator
  c10::DataPtr allocate(size_t nbytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  // ---- c10::DeviceAllocator
  bool initialized() override;
  void emptyCache(c10::MempoolId_t mempool_id = {0, 0}) override;
  using CCA::CUDAAllocator::recordStream;
  DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;

  // ---- CUDAAllocator
  void* raw_alloc(size_t nbytes) override;
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  void init(int device_count) override;
  double getMemoryFraction(c10::DeviceIndex device) override;
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex device) override;
  void enable(bool value) override;
  bool isEnabled() const override;
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override;
  void* getBaseAllocation(void* ptr, size_t* size) override;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override;
  // recordStream for a use whose work on `stream` is all enqueued already (the offloader's
  // copies): the free waits for this point of `stream` only. Memory we did not allocate: a
  // no-op, as recordStream.
  void recordStreamEnqueued(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream);
  CCA::SnapshotInfo snapshot(
      c10::MempoolId_t mempool_id = {0, 0},
      bool include_traces = true) override;
  void beginAllocateToPool(
      c10::DeviceIndex device,
      c10::MempoolId_t mempool_id,
      std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void createOrIncrefPool(
      c10::DeviceIndex device,
      c10::MempoolId_t mempool_id,
      std::shared_ptr<CCA::CUDAAllocator> allocator = nullptr) override;
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id, bool use_on_oom)
      override;
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  bool checkPoolLiveAllocations(
      c10::DeviceIndex device,
      c10::MempoolId_t mempool_id,
      const std::unordered_set<void*>& expected_live_allocations) override;
  CCA::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;
  bool isHistoryEnabled() override;
  void recordHistory(
      bool enabled,
      CCA::CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      CCA::RecordContext when,
      bool clearHistory,
      const std::vector<std::string>& skip_actions) override;
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override;
  void pushCompileContext(std::string& md) override;
  void popCompileContext() override;
  void setUserMetadata(const std::string& metadata) override;
  std::string getUserMetadata() override;
  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 12)
  void attachOomRejectionObserver(CCA::OomRejectionObserver observer) override;
#endif
  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override;
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(
      void* dst,
      int dstDevice,
      const void* src,
      int srcDevice,
      size_t count,
      cudaStream_t stream,
      bool p2p_enabled) override;
  std::shared_ptr<CCA::AllocatorState> getCheckpointState(
      c10::DeviceIndex device,
      c10::MempoolId_t id) override;
  CCA::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<CCA::AllocatorState> pps) override;
  std::string name() override;

  // ---- stweaver
  // The DataPtr deleter's target. Never throws (it runs in destructors); a failed free is
  // reported on stderr and counted.
  void free_noexcept(void* ptr) noexcept;
  // The Rust runtime behind this allocator: step(), step_key(), iteration_key(), mark(),
  // mode(), info_json(), flush_trace() (see the API notes at the top of this file).
  ffi::Runtime& runtime() { return *runtime_; }
  // Frees that failed (unknown pointer, double free): reported on stderr and counted.
  int64_t failed_frees() const { return failed_frees_.load(); }

 private:
  // recordStream (enqueued false) and recordStreamEnqueued (true).
  void record_use(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream, bool enqueued);
  void* malloc_impl(c10::DeviceIndex device, size_t nbytes, cudaStream_t stream);
  ffi::PoolId route(c10::DeviceIndex device, cudaStream_t stream);
  [[noreturn]] void raise_oom(c10::DeviceIndex device, size_t nbytes, cudaStream_t stream);
  void free_impl(void* ptr);
  // Pulls the engine's history events and appends them to the trace (with `ctx` attached
  // to the entry for `ctx_addr`), and feeds the trace trackers.
  void flush_history(
      const std::shared_ptr<c10::GatheredContext>& ctx,
      uint64_t ctx_addr);
  void push_entry(TraceEntry entry);  // requires history_mu_
  void update_rust_history_flag();      // requires history_mu_
  std::string compile_context() const;

  rust::Box<ffi::Runtime> runtime_;
  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  int device_count_ = 0;
  std::atomic<int64_t> failed_frees_{0};

  // Private-pool routing: (device, pool, filter), searched newest first.
  std::mutex pools_mu_;
  std::vector<std::tuple<c10::DeviceIndex, c10::MempoolId_t, std::function<bool(cudaStream_t)>>>
      active_pools_;
  std::atomic<int> n_active_pools_{0};

  // History (torch.cuda.memory._record_memory_history) and trace trackers.
  std::atomic<bool> tracking_{false};  // history enabled or trackers attached
  mutable std::mutex history_mu_;
  bool history_enabled_ = false;
  CCA::CreateContextFn context_recorder_ = nullptr;
  CCA::RecordContext record_context_ = CCA::RecordContext::NEVER;
  size_t max_entries_ = 0;
  std::unordered_set<int> skip_actions_;
  std::vector<std::deque<TraceEntry>> traces_;  // per device, oldest first
  std::vector<c10::CachingDeviceAllocator::AnnotationEntry> annotations_;
  std::unordered_map<uint64_t, std::shared_ptr<c10::GatheredContext>> block_contexts_;
  std::vector<CCA::AllocatorTraceTracker> trace_trackers_;
  std::string user_metadata_;
  c10::ApproximateClockToUnixTimeConverter clock_converter_;

  std::mutex observers_mu_;
  std::vector<CCA::OutOfMemoryObserver> oom_observers_;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 12)
  std::vector<CCA::OomRejectionObserver> oom_rejection_observers_;
#endif
};

// The installed allocator, or nullptr (stweaver not installed).
StweaverAllocator* installed();

// Installs stweaver as THE CUDA allocator: refuses if CUDA is already initialised, stores it
// in CUDACachingAllocator::allocator and calls c10::SetAllocator(kCUDA). A second call with
// the same settings is a no-op; with different settings it is an error. `mode`, `plan` and
// `trace`: see the API notes at the top of this file.
void install(const std::string& mode, const std::string& plan, const std::string& trace);

}  // namespace stweaver
