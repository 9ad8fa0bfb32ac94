"""Out of memory under stweaver: torch.OutOfMemoryError with a useful message, observers
called, and training goes on afterwards."""

import pytest
import torch

GIB = 1 << 30


def test_oom_raises_and_training_continues(metric):
    torch.ones(1, device="cuda")  # CUDA's lazy init (memory_stats() is {} before it)
    seen = []
    torch._C._cuda_attach_out_of_memory_observer(
        lambda device, alloc, total, free: seen.append((device, alloc, total, free))
    )
    before = torch.cuda.memory_stats()["num_ooms"]
    big = 200 * GIB  # more than the device has
    with pytest.raises(torch.OutOfMemoryError) as ei:
        torch.empty(big, dtype=torch.uint8, device="cuda")
    msg = str(ei.value)
    assert "CUDA out of memory" in msg and "stweaver" in msg, msg
    assert "Tried to allocate 200.00 GiB" in msg, msg
    assert seen and seen[-1][1] == big and seen[-1][0] == 0, seen
    assert torch.cuda.memory_stats()["num_ooms"] == before + 1

    # The per-process memory fraction is enforced the same way.
    torch.cuda.set_per_process_memory_fraction(0.05)
    try:
        with pytest.raises(torch.OutOfMemoryError, match="set_per_process_memory_fraction"):
            torch.empty(20 * GIB, dtype=torch.uint8, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)

    # Training carries on.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        loss = model(torch.randn(128, 256, device="cuda")).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.isfinite(loss).item()
    metric("oom_message_chars", len(msg))
