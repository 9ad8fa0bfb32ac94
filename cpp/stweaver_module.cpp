// The Python extension module (stweaver._C): install the allocator and talk to its runtime.
// Loading this module never initialises CUDA.
#include <torch/extension.h>

#include <c10/cuda/CUDAFunctions.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "offload_copy.h"
#include "stweaver_allocator.h"

namespace {

stweaver::StweaverAllocator& need_installed(const char* what) {
  stweaver::StweaverAllocator* a = stweaver::installed();
  TORCH_CHECK(a != nullptr, "stweaver.", what, "(): stweaver is not installed (call stweaver.install() first)");
  return *a;
}

template <typename F>
auto call(const char* what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const rust::Error& e) {
    TORCH_CHECK(false, "stweaver.", what, "(): ", e.what());
    throw;
  }
}

// -1: the current CUDA device.
int device_or_current(int device) {
  return device < 0 ? static_cast<int>(c10::cuda::current_device()) : device;
}

uint32_t checked_tag(const char* what, int64_t tag) {
  TORCH_CHECK(tag >= 0 && tag <= UINT32_MAX, "stweaver.", what, "(): tag ", tag, " is not a u32");
  return static_cast<uint32_t>(tag);
}

std::tuple<int64_t, int64_t, int64_t, int64_t> as_tuple(const stweaver::ffi::PauseReport& r) {
  return std::make_tuple(
      static_cast<int64_t>(r.blocks),
      static_cast<int64_t>(r.units),
      static_cast<int64_t>(r.bytes),
      static_cast<int64_t>(r.copied));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "stweaver: a planning CUDA allocator for PyTorch (C++ side of the Rust engine)";
  m.attr("torch_version") = TORCH_VERSION;
  stweaver_offload::register_offload_copy(m);

  m.def(
      "install",
      [](const std::string& mode, const std::string& plan, const std::string& trace) {
        stweaver::install(mode, plan, trace);
      },
      py::arg("mode") = "online",
      py::arg("plan") = "",
      py::arg("trace") = "",
      "Make stweaver the CUDA allocator. Must run before CUDA is initialised.");

  m.def("is_installed", []() { return stweaver::installed() != nullptr; });

  m.def(
      "step",
      []() {
        auto& a = need_installed("step");
        call("step", [&] { a.runtime().step(); });
      },
      py::call_guard<py::gil_scoped_release>(),
      "Mark an iteration boundary.");

  m.def(
      "step_key",
      [](uint64_t key) {
        auto& a = need_installed("step");
        call("step", [&] { a.runtime().step_key(key); });
      },
      py::arg("key"),
      py::call_guard<py::gil_scoped_release>(),
      "Mark an iteration boundary where an iteration of key `key` (a 64-bit hash) begins.");

  m.def(
      "iteration_key",
      [](uint64_t key) {
        auto& a = need_installed("iteration_key");
        call("iteration_key", [&] { a.runtime().iteration_key(key); });
      },
      py::arg("key"),
      py::call_guard<py::gil_scoped_release>(),
      "The iteration in progress has key `key` (a 64-bit hash); no boundary.");

  m.def(
      "mark",
      [](const std::string& label, bool begin) {
        auto& a = need_installed("mark");
        call("mark", [&] { a.runtime().mark(label, begin); });
      },
      py::arg("label"),
      py::arg("begin") = true,
      py::call_guard<py::gil_scoped_release>(),
      "Open (begin=True) or close a named phase.");

  m.def("mode", []() {
    auto& a = need_installed("mode");
    return std::string(call("mode", [&] { return a.runtime().mode(); }));
  });

  m.def("info_json", []() {
    auto& a = need_installed("stats");
    return std::string(call("stats", [&] { return a.runtime().info_json(); }));
  });

  m.def(
      "flush_trace",
      []() {
        auto& a = need_installed("flush_trace");
        rust::Vec<rust::String> paths = call("flush_trace", [&] { return a.runtime().flush_trace(); });
        std::vector<std::string> out;
        out.reserve(paths.size());
        for (const auto& p : paths) {
          out.emplace_back(std::string(p));
        }
        return out;
      },
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "record_saved",
      [](int64_t ptr, bool pack) {
        auto& a = need_installed("record_saved");
        return call("record_saved", [&] {
          return a.runtime().record_saved(static_cast<size_t>(ptr), pack);
        });
      },
      py::arg("ptr"),
      py::arg("pack"),
      "Record that autograd saved (pack=True) or unpacked the tensor whose storage starts at "
      "ptr (trace mode and auto's recording). The allocation's trace id (>= 0), -1 when "
      "nothing was recorded.");

  m.def(
      "record_restore",
      [](int64_t ptr, int64_t from) {
        auto& a = need_installed("record_restore");
        return call("record_restore", [&] {
          return a.runtime().record_restore(static_cast<size_t>(ptr), from);
        });
      },
      py::arg("ptr"),
      py::arg("from_id"),
      "Record that the allocation starting at ptr is the copy back of the offloaded "
      "allocation from_id (an id record_saved returned for its pack). False when nothing "
      "was recorded.");

  m.def(
      "offload_schedule",
      [](int device) {
        auto& a = need_installed("offload_schedule");
        device = device_or_current(device);
        rust::Vec<stweaver::ffi::OffloadItem> items =
            call("offload_schedule", [&] { return a.runtime().offload_schedule(device); });
        std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
        out.reserve(items.size());
        for (const auto& it : items) {
          out.emplace_back(
              static_cast<int64_t>(it.pack),
              static_cast<int64_t>(it.unpack),
              it.prefetch_after_unpack,
              static_cast<int64_t>(it.bytes));
        }
        return out;
      },
      py::arg("device") = -1,
      "The served plan's offload schedule on `device` (-1: the current device): a list of "
      "(pack, unpack, prefetch_after_unpack or -1, bytes).");

  m.def(
      "call_times",
      []() {
        auto& a = need_installed("call_times");
        const stweaver::ffi::CallTimes t = a.runtime().call_times();
        py::dict d;
        d["on"] = t.on;
        d["malloc_ns"] = t.malloc_ns;
        d["malloc_calls"] = t.malloc_calls;
        d["free_ns"] = t.free_ns;
        d["free_calls"] = t.free_calls;
        return d;
      },
      "Cumulative host time in the allocator's malloc and free (STWEAVER_TIME_CALLS=1; "
      "zeros and on=False otherwise): a dict on, malloc_ns, malloc_calls, free_ns, free_calls.");

  m.def(
      "set_plan_gate",
      [](bool on) {
        auto& a = need_installed("set_plan_gate");
        call("set_plan_gate", [&] { a.runtime().set_plan_gate(on); });
      },
      py::arg("on"),
      "Auto mode: hold a finished plan (mode 'auto (plan held)', its offload outcome in "
      "info_json) instead of serving it, until release_held_plan.");

  m.def(
      "set_offload_timing",
      [](double link_gbps, double iteration_us) {
        auto& a = need_installed("set_offload_timing");
        call("set_offload_timing", [&] { a.runtime().set_offload_timing(link_gbps, iteration_us); });
      },
      py::arg("link_gbps"),
      py::arg("iteration_us") = 0.0,
      "Auto mode under a budget: time the next plans' offload schedules with this link "
      "speed (GB/s per direction) and device time per iteration (us) instead of the "
      "defaults (0: unchanged).");

  m.def(
      "release_held_plan",
      [](bool accept) {
        auto& a = need_installed("release_held_plan");
        call("release_held_plan", [&] { a.runtime().release_held_plan(accept); });
      },
      py::arg("accept"),
      "The held plan: accept=True serves it now (call at an iteration boundary), False "
      "drops it and auto mode records again from here.");

  m.def(
      "record_again",
      []() {
        auto& a = need_installed("record_again");
        call("record_again", [&] { a.runtime().record_again(); });
      },
      "Auto mode serving a plan: stop serving it and record again from this boundary; the "
      "served plan is kept for serve_kept_plan().");

  m.def(
      "serve_kept_plan",
      []() {
        auto& a = need_installed("serve_kept_plan");
        call("serve_kept_plan", [&] { a.runtime().serve_kept_plan(); });
      },
      "Serve the plan record_again() kept, from this boundary (the program it was made for "
      "must run again).");

  // Pause / resume (issue #17): tags and the device's memory given back, addresses kept.
  m.def(
      "set_tag",
      [](int64_t tag) {
        const uint32_t t = checked_tag("set_tag", tag);
        auto& a = need_installed("set_tag");
        call("set_tag", [&] { a.runtime().set_tag(t); });
      },
      py::arg("tag"),
      "The tag of allocations made from now on, on every pool of every device (0: untagged).");

  m.def(
      "pause",
      [](int64_t tag, bool keep, int device) {
        const uint32_t t = checked_tag("pause", tag);
        auto& a = need_installed("pause");
        device = device_or_current(device);
        return as_tuple(call("pause", [&] { return a.runtime().pause(device, t, keep); }));
      },
      py::arg("tag"),
      py::arg("keep") = true,
      py::arg("device") = -1,
      py::call_guard<py::gil_scoped_release>(),
      "Give the physical memory of the blocks of `tag` (0: every tagged block) on `device` "
      "(-1: the current device) back to the driver, addresses kept; contents saved on the "
      "host when `keep`. Synchronises the device. Returns (blocks, units, bytes, copied).");

  m.def(
      "resume",
      [](int64_t tag, int device) {
        const uint32_t t = checked_tag("resume", tag);
        auto& a = need_installed("resume");
        device = device_or_current(device);
        return as_tuple(call("resume", [&] { return a.runtime().resume(device, t); }));
      },
      py::arg("tag"),
      py::arg("device") = -1,
      py::call_guard<py::gil_scoped_release>(),
      "Map the paused memory of `tag` (0: every pause) on `device` (-1: the current device) "
      "again at the same addresses and restore the saved contents. Returns (blocks, units, "
      "bytes, copied).");

  m.def(
      "paused_bytes",
      [](int device) {
        auto& a = need_installed("paused_bytes");
        device = device_or_current(device);
        return static_cast<int64_t>(call("paused_bytes", [&] { return a.runtime().paused_bytes(device); }));
      },
      py::arg("device") = -1,
      "Bytes of `device` (-1: the current device) paused now.");

  m.def("failed_frees", []() {
    stweaver::StweaverAllocator* a = stweaver::installed();
    return a == nullptr ? int64_t{0} : a->failed_frees();
  });
}
