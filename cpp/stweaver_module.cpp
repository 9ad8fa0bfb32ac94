// The Python extension module (stweaver._C): install the allocator and talk to its runtime.
// Loading this module never initialises CUDA.
#include <torch/extension.h>

#include <string>
#include <vector>

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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "stweaver: a planning CUDA allocator for PyTorch (C++ side of the Rust engine)";
  m.attr("torch_version") = TORCH_VERSION;

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

  m.def("failed_frees", []() {
    stweaver::StweaverAllocator* a = stweaver::installed();
    return a == nullptr ? int64_t{0} : a->failed_frees();
  });
}
