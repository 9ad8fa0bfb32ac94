// A small libtorch training loop under stweaver (or PyTorch's own allocator, to compare).
//
//   train [native|online|auto|trace FILE|plan FILE] [steps]      (default: auto 30)
//
// stweaver::install() runs first, before any CUDA work; the loop marks each iteration with
// runtime().step() (what auto, trace and plan modes cut the run into). At the end it prints
// one line: the allocator, peak reserved and peak allocated bytes (c10's device stats, the
// numbers torch.cuda.max_memory_reserved() reports), and the last loss. Run it twice,
// `train native` and `train auto`, to see stweaver's peak next to native's; the seeded data
// makes both runs train the same model (same losses).
//
// Build: README.md ("Native C++"), cmake/stweaverConfig.cmake, or scripts/gpu_test.sh.
#include <torch/torch.h>

#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "stweaver_allocator.h"

namespace {

int usage() {
  std::fprintf(stderr, "usage: train [native|online|auto|trace FILE|plan FILE] [steps]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "auto";
  std::string file;
  int next = 2;
  if (mode == "trace" || mode == "plan") {
    if (argc < 3) {
      return usage();
    }
    file = argv[2];
    next = 3;
  } else if (mode != "native" && mode != "online" && mode != "auto") {
    return usage();
  }
  const int steps = argc > next ? std::atoi(argv[next]) : 30;
  if (steps <= 0) {
    return usage();
  }

  try {
    // First thing: no CUDA work may happen before the allocator is installed.
    if (mode != "native") {
      stweaver::install(mode, mode == "plan" ? file : "", mode == "trace" ? file : "");
    }
    if (!torch::cuda::is_available()) {
      std::fprintf(stderr, "train: no CUDA device\n");
      return 1;
    }
    torch::manual_seed(0);
    const torch::Device device(torch::kCUDA, 0);
    const int64_t batch = 512, in = 1024, hidden = 4096, classes = 16;
    torch::nn::Sequential model(
        torch::nn::Linear(in, hidden),
        torch::nn::ReLU(),
        torch::nn::Linear(hidden, hidden),
        torch::nn::ReLU(),
        torch::nn::Linear(hidden, hidden),
        torch::nn::ReLU(),
        torch::nn::Linear(hidden, classes));
    model->to(device);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-4));

    float last_loss = 0.0f;
    for (int step = 0; step < steps; ++step) {
      // Fresh random batches every step, drawn on the device (allocations every iteration).
      auto x = torch::randn({batch, in}, device);
      auto y = torch::randint(classes, {batch}, torch::TensorOptions().device(device).dtype(torch::kLong));
      opt.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
      loss.backward();
      opt.step();
      last_loss = loss.item<float>();
      if (auto* a = stweaver::installed()) {
        a->runtime().step();  // iteration boundary
      }
    }
    torch::cuda::synchronize();

    namespace CCA = c10::cuda::CUDACachingAllocator;
    const auto stats = CCA::getDeviceStats(0);
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    std::string name = CCA::allocator.load()->name();
    if (auto* a = stweaver::installed()) {
      name += " (" + std::string(a->runtime().mode()) + ")";
      if (mode == "trace") {
        for (const auto& path : a->runtime().flush_trace()) {
          std::fprintf(stderr, "train: trace written to %s\n", std::string(path).c_str());
        }
      }
    }
    std::printf(
        "allocator=%s peak_reserved=%lld peak_allocated=%lld steps=%d last_loss=%.6f\n",
        name.c_str(),
        static_cast<long long>(stats.reserved_bytes[all].peak),
        static_cast<long long>(stats.allocated_bytes[all].peak),
        steps,
        last_loss);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train: %s\n", e.what());
    return 1;
  }
  return 0;
}
