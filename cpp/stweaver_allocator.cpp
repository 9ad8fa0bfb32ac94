// stweaver's CUDAAllocator subclass: conversions only; the Rust runtime decides everything.
// See stweaver_allocator.h for the overview.
#include "stweaver_allocator.h"

#include <c10/core/Device.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace stweaver {

namespace {

using c10::CachingDeviceAllocator::AnnotationEntry;
using c10::CachingDeviceAllocator::BlockInfo;
using c10::CachingDeviceAllocator::SegmentInfo;

std::atomic<StweaverAllocator*> g_allocator{nullptr};
std::mutex g_install_mu;
std::string g_install_settings;

// The deleter of every DataPtr we hand out (cudagraph trees compare it with raw_deleter()).
void stweaver_raw_delete(void* ptr) {
  StweaverAllocator* a = g_allocator.load(std::memory_order_acquire);
  if (a != nullptr && ptr != nullptr) {
    a->free_noexcept(ptr);
  }
}

[[noreturn]] void throw_rust_error(const char* what, const rust::Error& e) {
  TORCH_CHECK(false, "stweaver: ", what, " failed: ", e.what());
  throw std::logic_error("unreachable");  // TORCH_CHECK(false) always throws
}

// Runs a bridge call, turning its Rust error into c10::Error.
template <typename F>
auto rs(const char* what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const rust::Error& e) {
    throw_rust_error(what, e);
  }
}

ffi::PoolId to_ffi(c10::MempoolId_t id) {
  return ffi::PoolId{static_cast<uint64_t>(id.first), static_cast<uint64_t>(id.second)};
}

bool is_default_pool(const ffi::PoolId& p) {
  return p.first == 0 && p.second == 0;
}

void copy_stat(c10::CachingAllocator::Stat& dst, const ffi::Stat& src) {
  dst.current = src.current;
  dst.peak = src.peak;
  dst.allocated = src.allocated;
  dst.freed = src.freed;
}

void copy_array(c10::CachingAllocator::StatArray& dst, const ffi::StatArray& src) {
  using c10::CachingAllocator::StatType;
  copy_stat(dst[static_cast<size_t>(StatType::AGGREGATE)], src.all);
  copy_stat(dst[static_cast<size_t>(StatType::SMALL_POOL)], src.small_pool);
  copy_stat(dst[static_cast<size_t>(StatType::LARGE_POOL)], src.large_pool);
}

TraceEntry::Action to_action(ffi::HistoryAction a) {
  switch (a) {
    case ffi::HistoryAction::Alloc:
      return TraceEntry::ALLOC;
    case ffi::HistoryAction::FreeRequested:
      return TraceEntry::FREE_REQUESTED;
    case ffi::HistoryAction::FreeCompleted:
      return TraceEntry::FREE_COMPLETED;
    case ffi::HistoryAction::SegmentAlloc:
      return TraceEntry::SEGMENT_ALLOC;
    case ffi::HistoryAction::SegmentFree:
      return TraceEntry::SEGMENT_FREE;
    case ffi::HistoryAction::SegmentMap:
      return TraceEntry::SEGMENT_MAP;
    case ffi::HistoryAction::SegmentUnmap:
      return TraceEntry::SEGMENT_UNMAP;
  }
  TORCH_CHECK(false, "stweaver: unknown history action ", static_cast<int>(a));
  throw std::logic_error("unreachable");
}

// "20.00 GiB", like PyTorch's format_size.
std::string format_size(uint64_t size) {
  std::ostringstream os;
  os.precision(2);
  os << std::fixed;
  if (size <= 1024) {
    os << size << " bytes";
  } else if (size <= 1048576) {
    os << (static_cast<double>(size) / 1024.0) << " KiB";
  } else if (size <= 1073741824ULL) {
    os << (static_cast<double>(size) / 1048576.0) << " MiB";
  } else {
    os << (static_cast<double>(size) / 1073741824.0) << " GiB";
  }
  return os.str();
}

thread_local std::vector<std::string> t_compile_context;

}  // namespace

StweaverAllocator::StweaverAllocator(rust::Box<ffi::Runtime> runtime)
    : runtime_(std::move(runtime)) {}

// ---------------------------------------------------------------- allocation

c10::DataPtr StweaverAllocator::allocate(size_t nbytes) {
  constexpr size_t one_exa_bytes = 1152921504606846976ULL;
  TORCH_CHECK_WITH(
      OutOfMemoryError,
      nbytes < one_exa_bytes,
      "CUDA out of memory. Tried to allocate more than 1EB memory.");
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  void* ptr = nullptr;
  if (nbytes > 0) {
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    ptr = malloc_impl(device, nbytes, stream);
  }
  return {ptr, ptr, &stweaver_raw_delete, c10::Device(c10::DeviceType::CUDA, device)};
}

c10::DeleterFnPtr StweaverAllocator::raw_deleter() const {
  return &stweaver_raw_delete;
}

void StweaverAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

void* StweaverAllocator::raw_alloc(size_t nbytes) {
  if (nbytes == 0) {
    return nullptr;
  }
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  return malloc_impl(device, nbytes, stream);
}

void* StweaverAllocator::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  if (nbytes == 0) {
    return nullptr;
  }
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return malloc_impl(device, nbytes, stream);
}

void StweaverAllocator::raw_delete(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  free_impl(ptr);
}

ffi::PoolId StweaverAllocator::route(c10::DeviceIndex device, cudaStream_t stream) {
  if (n_active_pools_.load(std::memory_order_acquire) == 0) {
    return ffi::PoolId{0, 0};
  }
  std::lock_guard<std::mutex> g(pools_mu_);
  for (auto it = active_pools_.rbegin(); it != active_pools_.rend(); ++it) {
    if (std::get<0>(*it) == device && std::get<2>(*it)(stream)) {
      return to_ffi(std::get<1>(*it));
    }
  }
  return ffi::PoolId{0, 0};
}

void* StweaverAllocator::malloc_impl(
    c10::DeviceIndex device,
    size_t nbytes,
    cudaStream_t stream) {
  TORCH_CHECK(
      initialized_.load(std::memory_order_acquire),
      "stweaver: CUDA allocation before the allocator was initialised by CUDA's lazy init");
  const ffi::PoolId pool = route(device, stream);
  std::shared_ptr<c10::GatheredContext> ctx;
  const bool tracking = tracking_.load(std::memory_order_acquire);
  if (tracking) {
    CCA::CreateContextFn recorder = nullptr;
    CCA::RecordContext when = CCA::RecordContext::NEVER;
    {
      std::lock_guard<std::mutex> g(history_mu_);
      recorder = context_recorder_;
      when = record_context_;
    }
    // Gathered outside every lock: it may take the GIL.
    if (recorder != nullptr && when != CCA::RecordContext::NEVER) {
      ctx = recorder();
    }
  }
  size_t ptr = 0;
  {
    // Private pools serve CUDA graph captures. Mapping memory (cuMemCreate/cuMemMap) is not
    // allowed in a global-mode capture; native relaxes the mode around cudaMalloc the same way.
    std::optional<c10::cuda::CUDAStreamCaptureModeGuard> relaxed;
    if (!is_default_pool(pool)) {
      relaxed.emplace(cudaStreamCaptureModeRelaxed);
    }
    ptr = rs("malloc", [&] {
      return runtime_->malloc(device, nbytes, reinterpret_cast<size_t>(stream), pool);
    });
  }
  if (tracking) {
    flush_history(ctx, static_cast<uint64_t>(ptr));
  }
  if (ptr == 0) {
    raise_oom(device, nbytes, stream);
  }
  return reinterpret_cast<void*>(ptr);
}

void StweaverAllocator::raise_oom(
    c10::DeviceIndex device,
    size_t nbytes,
    cudaStream_t stream) {
  const ffi::OomInfo info = rs("oom_info", [&] { return runtime_->oom_info(device, nbytes); });
  if (tracking_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(history_mu_);
    push_entry(TraceEntry(
        TraceEntry::OOM,
        device,
        static_cast<size_t>(info.device_free),
        static_cast<size_t>(info.rounded),
        stream,
        {0, 0},
        c10::getApproximateTime(),
        nullptr,
        compile_context(),
        user_metadata_));
  }
  // Observers run with no allocator lock held (they may dump a snapshot through Python).
  std::vector<CCA::OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::mutex> g(observers_mu_);
    observers = oom_observers_;
  }
  for (const auto& obs : observers) {
    obs(device, static_cast<size_t>(info.rounded), static_cast<size_t>(info.limit),
        static_cast<size_t>(info.device_free));
  }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 12)
  if (info.limit < info.device_total) {
    std::vector<CCA::OomRejectionObserver> rejections;
    {
      std::lock_guard<std::mutex> g(observers_mu_);
      rejections = oom_rejection_observers_;
    }
    for (const auto& obs : rejections) {
      obs(device, static_cast<size_t>(info.rounded), static_cast<size_t>(info.allocated),
          static_cast<size_t>(info.device_total));
    }
  }
#endif
  const uint64_t cached = info.reserved > info.allocated ? info.reserved - info.allocated : 0;
  std::ostringstream limit;
  if (info.limit < info.device_total) {
    limit << " The allowed memory (stweaver budget or set_per_process_memory_fraction) is "
          << format_size(info.limit) << ".";
  }
  TORCH_CHECK_WITH(
      OutOfMemoryError,
      false,
      "CUDA out of memory. Tried to allocate ",
      format_size(nbytes),
      ". GPU ",
      static_cast<int>(device),
      " has a total capacity of ",
      format_size(info.device_total),
      " of which ",
      format_size(info.device_free),
      " is free.",
      limit.str(),
      " Of the allocated memory ",
      format_size(info.allocated),
      " is allocated by PyTorch (stweaver allocator), and ",
      format_size(cached),
      " is reserved by stweaver but unallocated. ",
      std::string(info.detail));
  throw std::logic_error("unreachable");
}

void StweaverAllocator::free_impl(void* ptr) {
  std::shared_ptr<c10::GatheredContext> ctx;
  const bool tracking = tracking_.load(std::memory_order_acquire);
  if (tracking) {
    CCA::CreateContextFn recorder = nullptr;
    CCA::RecordContext when = CCA::RecordContext::NEVER;
    {
      std::lock_guard<std::mutex> g(history_mu_);
      recorder = context_recorder_;
      when = record_context_;
    }
    if (recorder != nullptr && when == CCA::RecordContext::ALL) {
      ctx = recorder();
    }
  }
  try {
    runtime_->free(reinterpret_cast<size_t>(ptr));
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "invalid device pointer: ", ptr, " (stweaver: ", e.what(), ")");
  }
  if (tracking) {
    flush_history(ctx, reinterpret_cast<uint64_t>(ptr));
  }
  if (!enabled_.load(std::memory_order_relaxed)) {
    // caching_allocator_enable(False): nothing stays cached.
    rs("empty_cache", [&] { runtime_->empty_cache(-1, ffi::PoolId{0, 0}); });
  }
}

void StweaverAllocator::free_noexcept(void* ptr) noexcept {
  try {
    free_impl(ptr);
  } catch (const std::exception& e) {
    failed_frees_.fetch_add(1);
    std::fprintf(stderr, "stweaver: freeing %p failed: %s\n", ptr, e.what());
  } catch (...) {
    failed_frees_.fetch_add(1);
    std::fprintf(stderr, "stweaver: freeing %p failed with an unknown exception\n", ptr);
  }
}

void StweaverAllocator::recordStream(
    const c10::DataPtr& ptr,
    c10::cuda::CUDAStream stream) {
  record_use(ptr, stream, false);
}

void StweaverAllocator::recordStreamEnqueued(
    const c10::DataPtr& ptr,
    c10::cuda::CUDAStream stream) {
  record_use(ptr, stream, true);
}

void StweaverAllocator::record_use(
    const c10::DataPtr& ptr,
    c10::cuda::CUDAStream stream,
    bool enqueued) {
  // Ignore empty DataPtrs and memory we did not allocate (e.g. IPC-imported storages).
  if (ptr.get() == nullptr || ptr.get_deleter() != &stweaver_raw_delete) {
    return;
  }
  const auto p = reinterpret_cast<size_t>(ptr.get());
  const auto s = reinterpret_cast<size_t>(stream.stream());
  if (enqueued) {
    rs("record_stream_enqueued", [&] { runtime_->record_stream_enqueued(p, s); });
  } else {
    rs("record_stream", [&] { runtime_->record_stream(p, s); });
  }
}

// ---------------------------------------------------------------- lifecycle, caching, stats

bool StweaverAllocator::initialized() {
  return initialized_.load(std::memory_order_acquire);
}

void StweaverAllocator::init(int device_count) {
  rs("init", [&] { runtime_->init(device_count); });
  {
    std::lock_guard<std::mutex> g(history_mu_);
    device_count_ = device_count;
    traces_.resize(static_cast<size_t>(std::max(device_count, 0)));
  }
  initialized_.store(true, std::memory_order_release);
}

void StweaverAllocator::emptyCache(c10::MempoolId_t mempool_id) {
  rs("empty_cache", [&] { runtime_->empty_cache(-1, to_ffi(mempool_id)); });
  if (tracking_.load(std::memory_order_acquire)) {
    flush_history(nullptr, 0);
  }
}

void StweaverAllocator::enable(bool value) {
  enabled_.store(value);
}

bool StweaverAllocator::isEnabled() const {
  return enabled_.load();
}

DeviceStats StweaverAllocator::getDeviceStats(c10::DeviceIndex device) {
  const ffi::DeviceStats s = rs("device_stats", [&] { return runtime_->device_stats(device); });
  DeviceStats out;
  copy_array(out.allocation, s.allocation);
  copy_array(out.segment, s.segment);
  copy_array(out.active, s.active);
  copy_array(out.inactive_split, s.inactive_split);
  copy_array(out.allocated_bytes, s.allocated_bytes);
  copy_array(out.reserved_bytes, s.reserved_bytes);
  copy_array(out.active_bytes, s.active_bytes);
  copy_array(out.inactive_split_bytes, s.inactive_split_bytes);
  copy_array(out.requested_bytes, s.requested_bytes);
  out.num_alloc_retries = s.num_alloc_retries;
  out.num_ooms = s.num_ooms;
  copy_stat(out.oversize_allocations, s.oversize_allocations);
  copy_stat(out.oversize_segments, s.oversize_segments);
  out.num_sync_all_streams = s.num_sync_all_streams;
  out.num_device_alloc = s.num_device_alloc;
  out.num_device_free = s.num_device_free;
  out.max_split_size = s.max_split_size;
  return out;
}

void StweaverAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  rs("reset_accumulated_stats", [&] { runtime_->reset_accumulated_stats(device); });
}

void StweaverAllocator::resetPeakStats(c10::DeviceIndex device) {
  rs("reset_peak_stats", [&] { runtime_->reset_peak_stats(device); });
}

double StweaverAllocator::getMemoryFraction(c10::DeviceIndex device) {
  return rs("memory_fraction", [&] { return runtime_->memory_fraction(device); });
}

void StweaverAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  TORCH_CHECK(
      0 <= fraction && fraction <= 1,
      "invalid fraction:",
      fraction,
      ". Please set within [0, 1].");
  rs("set_memory_fraction", [&] { runtime_->set_memory_fraction(device, fraction); });
}

std::vector<CCA::StreamSegmentSize> StweaverAllocator::getExpandableSegmentSizes(
    c10::DeviceIndex /*device*/) {
  // stweaver's arenas are not PyTorch expandable segments (which this reports on for
  // NCCL's symmetric-memory sizing); there are none.
  return {};
}

void StweaverAllocator::cacheInfo(c10::DeviceIndex device, size_t* largestBlock) {
  TORCH_CHECK(largestBlock != nullptr, "stweaver: cacheInfo needs an output pointer");
  if (*largestBlock == 0) {
    c10::cuda::CUDAGuard guard(device);
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    *largestBlock = free_bytes;
  }
  const uint64_t cached =
      rs("largest_free_block", [&] { return runtime_->largest_free_block(device); });
  *largestBlock = std::max(*largestBlock, static_cast<size_t>(cached));
}

void* StweaverAllocator::getBaseAllocation(void* ptr, size_t* size) {
  const ffi::Range r =
      rs("base_allocation", [&] { return runtime_->base_allocation(reinterpret_cast<size_t>(ptr)); });
  if (size != nullptr) {
    *size = static_cast<size_t>(r.size);
  }
  return reinterpret_cast<void*>(r.base);
}

// ---------------------------------------------------------------- snapshot and history

CCA::SnapshotInfo StweaverAllocator::snapshot(c10::MempoolId_t mempool_id, bool include_traces) {
  const ffi::PoolId pool = to_ffi(mempool_id);
  const ffi::Snapshot snap =
      rs("snapshot", [&] { return runtime_->snapshot(pool, is_default_pool(pool)); });
  CCA::SnapshotInfo out;
  std::vector<uint64_t> active_per_device(static_cast<size_t>(std::max(device_count_, 0)), 0);
  std::lock_guard<std::mutex> g(history_mu_);
  out.segments.reserve(snap.segments.size());
  for (const ffi::SnapshotSegment& seg : snap.segments) {
    SegmentInfo si;
    si.device = static_cast<c10::DeviceIndex>(seg.device);
    si.address = static_cast<size_t>(seg.address);
    si.total_size = static_cast<size_t>(seg.total_size);
    si.requested_size = static_cast<size_t>(seg.requested_size);
    si.allocated_size = static_cast<size_t>(seg.allocated_size);
    si.active_size = static_cast<size_t>(seg.active_size);
    si.stream = reinterpret_cast<void*>(seg.stream);
    si.is_large = seg.is_large;
    si.is_expandable = seg.is_expandable;
    si.owner_private_pool_id = {seg.pool.first, seg.pool.second};
    TORCH_CHECK(
        seg.first_block + seg.num_blocks <= snap.blocks.size(),
        "stweaver: snapshot segment refers to blocks past the end");
    si.blocks.reserve(seg.num_blocks);
    for (size_t i = seg.first_block; i < seg.first_block + seg.num_blocks; ++i) {
      const ffi::SnapshotBlock& b = snap.blocks[i];
      BlockInfo bi;
      bi.size = static_cast<size_t>(b.size);
      bi.requested_size = static_cast<size_t>(b.requested_size);
      bi.allocated = b.allocated;
      bi.active = b.active;
      if (b.active) {
        auto it = block_contexts_.find(b.address);
        if (it != block_contexts_.end()) {
          bi.context_when_allocated = it->second;
        }
      }
      si.blocks.push_back(std::move(bi));
    }
    if (seg.device >= 0 && static_cast<size_t>(seg.device) < active_per_device.size()) {
      active_per_device[static_cast<size_t>(seg.device)] += seg.active_size;
    }
    out.segments.push_back(std::move(si));
  }

  if (include_traces) {
    // Trace times are recorded as TSC values; torch expects µs since the epoch.
    auto tsc_to_ns = clock_converter_.makeConverter();
    out.device_traces.reserve(traces_.size());
    for (const auto& dq : traces_) {
      std::vector<TraceEntry> v(dq.begin(), dq.end());
      for (auto& te : v) {
        te.time_.t_ = tsc_to_ns(te.time_.approx_t_) / 1000;
      }
      out.device_traces.push_back(std::move(v));
    }
    out.external_annotations = annotations_;
    for (auto& ae : out.external_annotations) {
      ae.time_.t_ = tsc_to_ns(ae.time_.approx_t_) / 1000;
    }
  }

  auto& md = out.config_metadata;
  md.garbage_collection_threshold = 0.0;
  md.max_split_size = std::numeric_limits<size_t>::max();  // stweaver splits any block
  md.pinned_num_register_threads = 1;
  md.expandable_segments = true;  // arenas grow by mapping granules
  md.release_lock_on_malloc = true;
  md.pinned_use_host_register = false;
  md.graph_capture_record_stream_reuse = false;
  md.last_allocator_settings = "stweaver";
  md.roundup_power2_divisions.assign(16, 0);

  if (history_enabled_) {
    for (size_t d = 0; d < active_per_device.size(); ++d) {
      push_entry(TraceEntry(
          TraceEntry::SNAPSHOT,
          static_cast<c10::DeviceIndex>(d),
          0,
          static_cast<size_t>(active_per_device[d]),
          nullptr,
          {0, 0},
          c10::getApproximateTime(),
          nullptr,
          compile_context(),
          user_metadata_));
    }
  }
  return out;
}

void StweaverAllocator::push_entry(TraceEntry entry) {
  for (const auto& tracker : trace_trackers_) {
    tracker(entry);
  }
  if (!history_enabled_ || skip_actions_.count(static_cast<int>(entry.action_)) != 0) {
    return;
  }
  const auto dev = static_cast<size_t>(entry.device_);
  if (dev >= traces_.size()) {
    traces_.resize(dev + 1);
  }
  auto& dq = traces_[dev];
  dq.push_back(std::move(entry));
  while (dq.size() > max_entries_) {
    dq.pop_front();
  }
}

void StweaverAllocator::flush_history(
    const std::shared_ptr<c10::GatheredContext>& ctx,
    uint64_t ctx_addr) {
  rust::Vec<ffi::HistoryEvent> events =
      rs("drain_history", [&] { return runtime_->drain_history(); });
  if (events.empty()) {
    return;
  }
  const auto now = c10::getApproximateTime();
  std::lock_guard<std::mutex> g(history_mu_);
  const std::string cc = compile_context();
  for (const ffi::HistoryEvent& e : events) {
    const TraceEntry::Action action = to_action(e.action);
    std::shared_ptr<c10::GatheredContext> c;
    if (ctx && e.addr == ctx_addr) {
      if (action == TraceEntry::ALLOC) {
        // STATE keeps stacks only for live blocks (the snapshot), ALLOC and ALL in the trace.
        block_contexts_[e.addr] = ctx;
        if (record_context_ == CCA::RecordContext::ALLOC ||
            record_context_ == CCA::RecordContext::ALL) {
          c = ctx;
        }
      } else if (
          action == TraceEntry::FREE_REQUESTED &&
          record_context_ == CCA::RecordContext::ALL) {
        c = ctx;
      }
    }
    if (action == TraceEntry::FREE_COMPLETED) {
      block_contexts_.erase(e.addr);
    }
    push_entry(TraceEntry(
        action,
        static_cast<c10::DeviceIndex>(e.device),
        static_cast<size_t>(e.addr),
        static_cast<size_t>(e.size),
        reinterpret_cast<void*>(e.stream),
        {e.pool.first, e.pool.second},
        now,
        std::move(c),
        cc,
        user_metadata_));
  }
}

void StweaverAllocator::update_rust_history_flag() {
  const bool on = history_enabled_ || !trace_trackers_.empty();
  rs("set_history", [&] { runtime_->set_history(on); });
  tracking_.store(on, std::memory_order_release);
}

bool StweaverAllocator::isHistoryEnabled() {
  std::lock_guard<std::mutex> g(history_mu_);
  return history_enabled_;
}

void StweaverAllocator::recordHistory(
    bool enabled,
    CCA::CreateContextFn context_recorder,
    size_t alloc_trace_max_entries,
    CCA::RecordContext when,
    bool clearHistory,
    const std::vector<std::string>& skip_actions) {
  TORCH_CHECK(
      when == CCA::RecordContext::NEVER || context_recorder != nullptr,
      "stweaver: recordHistory needs a context recorder unless context is NEVER");
  std::unordered_set<int> skip;
  for (const std::string& s : skip_actions) {
    skip.insert(static_cast<int>(c10::CachingDeviceAllocator::parseTraceEntryAction(s)));
  }
  std::lock_guard<std::mutex> g(history_mu_);
  history_enabled_ = enabled;
  context_recorder_ = enabled ? context_recorder : nullptr;
  record_context_ = enabled ? when : CCA::RecordContext::NEVER;
  max_entries_ = std::max<size_t>(alloc_trace_max_entries, 1);
  skip_actions_ = std::move(skip);
  if (!enabled || clearHistory) {
    for (auto& dq : traces_) {
      dq.clear();
    }
    annotations_.clear();
  }
  if (!enabled) {
    block_contexts_.clear();
  }
  update_rust_history_flag();
}

void StweaverAllocator::recordAnnotation(
    const std::vector<std::pair<std::string, std::string>>& md) {
  std::lock_guard<std::mutex> g(history_mu_);
  if (!history_enabled_) {
    return;
  }
  c10::DeviceIndex device = 0;
  if (c10::cuda::GetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    device = 0;
  }
  AnnotationEntry ae(device, c10::getApproximateTime());
  for (const auto& [k, v] : md) {
    ae.recordUserMetadata(k, v);
  }
  annotations_.push_back(std::move(ae));
}

void StweaverAllocator::pushCompileContext(std::string& md) {
  t_compile_context.push_back(md);
}

void StweaverAllocator::popCompileContext() {
  if (!t_compile_context.empty()) {
    t_compile_context.pop_back();
  }
}

std::string StweaverAllocator::compile_context() const {
  return t_compile_context.empty() ? std::string() : t_compile_context.back();
}

void StweaverAllocator::setUserMetadata(const std::string& metadata) {
  std::lock_guard<std::mutex> g(history_mu_);
  user_metadata_ = metadata;
}

std::string StweaverAllocator::getUserMetadata() {
  std::lock_guard<std::mutex> g(history_mu_);
  return user_metadata_;
}

void StweaverAllocator::attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> g(observers_mu_);
  oom_observers_.push_back(std::move(observer));
}

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 12)
void StweaverAllocator::attachOomRejectionObserver(CCA::OomRejectionObserver observer) {
  std::lock_guard<std::mutex> g(observers_mu_);
  oom_rejection_observers_.push_back(std::move(observer));
}
#endif

void StweaverAllocator::attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) {
  std::lock_guard<std::mutex> g(history_mu_);
  trace_trackers_.push_back(std::move(tracker));
  update_rust_history_flag();
}

// ---------------------------------------------------------------- private pools

void StweaverAllocator::beginAllocateToPool(
    c10::DeviceIndex device,
    c10::MempoolId_t mempool_id,
    std::function<bool(cudaStream_t)> filter) {
  // A capture begins: until endAllocateToPool the device is never synchronised (no cache
  // given back), which would invalidate the capture.
  rs("pool_begin_allocate", [&] { runtime_->pool_begin_allocate(device, to_ffi(mempool_id)); });
  std::lock_guard<std::mutex> g(pools_mu_);
  active_pools_.emplace_back(device, mempool_id, std::move(filter));
  n_active_pools_.store(static_cast<int>(active_pools_.size()), std::memory_order_release);
}

void StweaverAllocator::endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  std::lock_guard<std::mutex> g(pools_mu_);
  for (auto it = active_pools_.rbegin(); it != active_pools_.rend(); ++it) {
    if (std::get<0>(*it) == device && std::get<1>(*it) == mempool_id) {
      active_pools_.erase(std::next(it).base());
      n_active_pools_.store(static_cast<int>(active_pools_.size()), std::memory_order_release);
      rs("pool_end_allocate", [&] { runtime_->pool_end_allocate(device, to_ffi(mempool_id)); });
      return;
    }
  }
  TORCH_CHECK(
      false,
      "stweaver: endAllocateToPool: no allocation to pool (",
      mempool_id.first,
      ", ",
      mempool_id.second,
      ") is in progress on device ",
      static_cast<int>(device));
}

void StweaverAllocator::releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  rs("pool_release", [&] { runtime_->pool_release(device, to_ffi(mempool_id)); });
}

int StweaverAllocator::getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  return rs("pool_use_count", [&] { return runtime_->pool_use_count(device, to_ffi(mempool_id)); });
}

void StweaverAllocator::createOrIncrefPool(
    c10::DeviceIndex device,
    c10::MempoolId_t mempool_id,
    std::shared_ptr<CCA::CUDAAllocator> allocator) {
  TORCH_CHECK(
      allocator == nullptr,
      "stweaver: torch.cuda.MemPool(allocator=...) is not supported: a pool's memory always "
      "comes from stweaver's engine");
  rs("pool_incref", [&] { runtime_->pool_incref(device, to_ffi(mempool_id)); });
}

void StweaverAllocator::setUseOnOOM(
    c10::DeviceIndex /*device*/,
    c10::MempoolId_t /*mempool_id*/,
    bool use_on_oom) {
  // MemPool's destructor always calls this with false; there is nothing to undo.
  TORCH_CHECK(
      !use_on_oom,
      "stweaver: torch.cuda.MemPool(use_on_oom=True) is not supported (a private pool's "
      "free memory is never lent to other allocations)");
}

void StweaverAllocator::setNoSplit(c10::DeviceIndex /*device*/, c10::MempoolId_t /*mempool_id*/) {
  TORCH_CHECK(
      false,
      "stweaver: torch.cuda.MemPool(no_split=True) is not supported (stweaver splits blocks "
      "in every pool)");
}

bool StweaverAllocator::checkPoolLiveAllocations(
    c10::DeviceIndex device,
    c10::MempoolId_t mempool_id,
    const std::unordered_set<void*>& expected_live_allocations) {
  const rust::Vec<size_t> live = rs("pool_live_allocations", [&] {
    return runtime_->pool_live_allocations(device, to_ffi(mempool_id));
  });
  if (live.size() != expected_live_allocations.size()) {
    return false;
  }
  for (size_t p : live) {
    if (expected_live_allocations.count(reinterpret_cast<void*>(p)) == 0) {
      return false;
    }
  }
  return true;
}

namespace {

// A private pool's checkpoint (CUDA graph trees hold it between recordings): the engine's
// list of the blocks allocated when it was taken, opaque here.
class StweaverCheckpoint final : public CCA::AllocatorState {
 public:
  StweaverCheckpoint(c10::DeviceIndex device, rust::Box<ffi::PoolCheckpoint> checkpoint)
      : device_(device), checkpoint_(std::move(checkpoint)) {}
  c10::DeviceIndex device() const { return device_; }
  const ffi::PoolCheckpoint& checkpoint() const { return *checkpoint_; }

 private:
  c10::DeviceIndex device_;
  rust::Box<ffi::PoolCheckpoint> checkpoint_;
};

}  // namespace

std::shared_ptr<CCA::AllocatorState> StweaverAllocator::getCheckpointState(
    c10::DeviceIndex device,
    c10::MempoolId_t id) {
  rust::Box<ffi::PoolCheckpoint> cp =
      rs("pool_checkpoint", [&] { return runtime_->pool_checkpoint(device, to_ffi(id)); });
  return std::make_shared<StweaverCheckpoint>(device, std::move(cp));
}

CCA::CheckpointDelta StweaverAllocator::setCheckpointPoolState(
    c10::DeviceIndex device,
    std::shared_ptr<CCA::AllocatorState> pps) {
  auto* cp = dynamic_cast<StweaverCheckpoint*>(pps.get());
  TORCH_CHECK(
      cp != nullptr,
      "stweaver: setCheckpointPoolState needs a checkpoint taken by stweaver's "
      "getCheckpointState (got another allocator's state)");
  TORCH_CHECK(
      cp->device() == device,
      "stweaver: checkpoint of device ",
      static_cast<int>(cp->device()),
      " restored on device ",
      static_cast<int>(device));
  const ffi::PoolRestore r =
      rs("pool_restore", [&] { return runtime_->pool_restore(device, cp->checkpoint()); });
  if (tracking_.load(std::memory_order_acquire)) {
    flush_history(nullptr, 0);
  }
  // Native's contract: every pointer freed, and a DataPtr per re-created block built like
  // allocate() builds them (our deleter, so cudagraph trees' deleter swaps recognise it).
  CCA::CheckpointDelta delta;
  delta.ptrs_freed.reserve(r.ptrs_freed.size());
  for (size_t p : r.ptrs_freed) {
    delta.ptrs_freed.push_back(reinterpret_cast<void*>(p));
  }
  delta.dataptrs_allocd.reserve(r.allocated.size());
  for (const ffi::CheckpointBlock& b : r.allocated) {
    void* ptr = reinterpret_cast<void*>(static_cast<std::uintptr_t>(b.address));
    delta.dataptrs_allocd.emplace_back(
        ptr, ptr, &stweaver_raw_delete, c10::Device(c10::DeviceType::CUDA, device));
  }
  return delta;
}

// ---------------------------------------------------------------- IPC, peers, copies

CCA::ShareableHandle StweaverAllocator::shareIpcHandle(void* /*ptr*/) {
  TORCH_CHECK(
      false,
      "stweaver does not support sharing CUDA memory between processes (CUDA IPC, e.g. "
      "torch.multiprocessing with CUDA tensors): its memory is mapped with cuMemMap without "
      "shareable handles. Send CPU tensors, or run the producer without stweaver.");
  throw std::logic_error("unreachable");
}

std::shared_ptr<void> StweaverAllocator::getIpcDevPtr(std::string /*handle*/) {
  TORCH_CHECK(
      false,
      "stweaver does not support opening CUDA IPC handles from other processes "
      "(torch.multiprocessing with CUDA tensors); run the consumer without stweaver.");
  throw std::logic_error("unreachable");
}

void StweaverAllocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
  }
  // cuMemMap'ped memory needs explicit access rights for the peer (like native's
  // expandable segments).
  rs("enable_peer_access", [&] { runtime_->enable_peer_access(dev, dev_to_access); });
}

cudaError_t StweaverAllocator::memcpyAsync(
    void* dst,
    int dstDevice,
    const void* src,
    int srcDevice,
    size_t count,
    cudaStream_t stream,
    bool p2p_enabled) {
  // All stweaver memory is cuMemMap'ped: without P2P, cudaMemcpyAsync across devices fails
  // on it, so use the peer copy (see the table in CUDACachingAllocator.h).
  if (p2p_enabled || dstDevice == srcDevice) {
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  }
  return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
}

std::string StweaverAllocator::name() {
  return "stweaver";
}

// ---------------------------------------------------------------- install

StweaverAllocator* installed() {
  return g_allocator.load(std::memory_order_acquire);
}

void install(const std::string& mode, const std::string& plan, const std::string& trace) {
  std::lock_guard<std::mutex> g(g_install_mu);
  const std::string settings = "mode=" + mode + " plan=" + plan + " trace=" + trace;
  if (g_allocator.load() != nullptr) {
    TORCH_CHECK(
        settings == g_install_settings,
        "stweaver is already installed with different settings (",
        g_install_settings,
        "); requested ",
        settings);
    return;
  }
  CCA::CUDAAllocator* current = CCA::allocator.load();
  TORCH_CHECK(
      current == nullptr || !current->initialized(),
      "stweaver.install() must run before CUDA is initialised, but the current CUDA allocator (",
      current == nullptr ? std::string("none") : current->name(),
      ") is already serving this process. Call stweaver.install() (or set STWEAVER_MODE) "
      "before the first CUDA tensor, torch.cuda.init(), torch.cuda.current_device() or "
      "torch.cuda.get_device_properties(); when building the extension at runtime set "
      "TORCH_CUDA_ARCH_LIST, since torch.utils.cpp_extension otherwise queries the GPU.");
  rust::Box<ffi::Runtime> runtime = [&] {
    try {
      return ffi::new_runtime(mode, plan, trace);
    } catch (const rust::Error& e) {
      throw_rust_error("install", e);
    }
  }();
  // Leaked on purpose: the allocator must outlive every DataPtr, including those freed
  // during interpreter shutdown (native's allocator is a function-level static).
  auto* a = new StweaverAllocator(std::move(runtime));
  g_allocator.store(a, std::memory_order_release);
  CCA::allocator.store(a);
  c10::SetAllocator(c10::DeviceType::CUDA, a, /*priority=*/1);
  g_install_settings = settings;
}

}  // namespace stweaver
