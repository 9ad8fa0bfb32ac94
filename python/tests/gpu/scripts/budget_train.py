"""The small training loop the budget probes run under their budget (imported by
budget_probe.py and shared_budget_probe.py, which sit beside it)."""


def train_under_budget(torch, stweaver) -> dict:
    """12 AdamW steps of a 2048-8192-2048 MLP on 4096 random rows, after the cache is
    emptied and the peak reset: whether the losses are finite, the peak reserved, the mode."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 2048)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for _ in range(12):
        xb = torch.randn(4096, 2048, device="cuda")
        loss = model(xb).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "train_losses_finite": all(v == v and abs(v) < float("inf") for v in losses),
        "train_max_reserved": torch.cuda.max_memory_reserved(),
        "train_mode": stweaver.mode(),
    }
