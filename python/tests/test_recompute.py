"""stweaver.recompute_blocks without a GPU: which blocks it finds and wraps, gradients equal
bit for bit to the run that stores everything (dropout included), undo, clear errors, and the
offloader's pack hook seeing only the saves outside recomputed blocks."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

torch = pytest.importorskip("torch")

import stweaver  # noqa: E402
from stweaver import RecomputeError, find_blocks, recompute_blocks  # noqa: E402
from stweaver._recompute import recomputed  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_offload import offloader  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, width, p):
        super().__init__()
        self.a = torch.nn.Linear(width, 2 * width)
        self.b = torch.nn.Linear(2 * width, width)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x, scale=1.0):
        return x + self.drop(self.b(torch.nn.functional.gelu(self.a(x)))) * scale


class Net(torch.nn.Module):
    def __init__(self, width=32, depth=6, p=0.1):
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.layers = torch.nn.ModuleList(Block(width, p) for _ in range(depth))
        self.heads = torch.nn.ModuleList([torch.nn.Linear(width, 1), torch.nn.Linear(width, 1)])

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, scale=0.5)
        return self.heads[0](h).square().mean() + self.heads[1](h).mean()


def step(model, x, seed=7, hooks=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout's masks
    if hooks is not None:
        with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
            loss = model(x)
    else:
        loss = model(x)
    loss.backward()
    return loss.detach().clone(), [p.grad.clone() for p in model.parameters()]


def fresh(depth=6, p=0.1):
    torch.manual_seed(0)
    return Net(depth=depth, p=p).train()


def test_find_blocks_takes_the_longest_list_of_one_class():
    name, blocks = find_blocks(fresh(depth=5))
    assert name == "layers" and len(blocks) == 5 and all(isinstance(b, Block) for b in blocks)
    with pytest.raises(RecomputeError, match="no repeated blocks"):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("where", ["last", "first"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_gradients_are_bitwise_those_of_storing_everything(k, where):
    x = torch.randn(16, 32)
    ref = step(fresh(), x)
    model = fresh()
    names = recompute_blocks(model, k, where=where)
    idx = list(range(6 - k, 6)) if where == "last" else list(range(k))
    assert names == [f"layers.{i}" for i in idx] and recomputed(model) == names
    for _ in range(2):  # twice: the wrapper holds no state between steps
        loss, grads = step(model, x)
        assert torch.equal(loss, ref[0])
        assert all(torch.equal(g, r) for g, r in zip(grads, ref[1]))


def test_k_zero_undoes_and_a_new_choice_replaces_the_old_one():
    model = fresh()
    recompute_blocks(model, 4)
    assert recomputed(model) == ["layers.2", "layers.3", "layers.4", "layers.5"]
    recompute_blocks(model, 2, where="first")
    assert recomputed(model) == ["layers.0", "layers.1"]
    recompute_blocks(model, 0)
    assert recomputed(model) == []
    assert all("forward" not in b.__dict__ for b in model.layers)


def test_an_instance_forward_set_by_the_user_comes_back_on_undo():
    model = fresh()
    blk = model.layers[5]
    calls = []

    def mine(x, scale=1.0):
        calls.append(1)
        return Block.forward(blk, x, scale)

    blk.forward = mine
    recompute_blocks(model, 1)
    step(model, torch.randn(4, 32))
    assert len(calls) == 2  # forward, then again in backward
    recompute_blocks(model, 0)
    assert blk.forward is mine


@pytest.mark.parametrize("k", [-1, 7, 1.5, True])
def test_k_out_of_range_is_refused(k):
    with pytest.raises(RecomputeError, match=r"0\.\.6"):
        recompute_blocks(fresh(), k)
    with pytest.raises(RecomputeError, match="where"):
        recompute_blocks(fresh(), 1, where="middle")


def test_the_offloader_sees_only_the_saves_outside_recomputed_blocks():
    """Counted packs drop with every recomputed block; threshold offload of what is left
    still round-trips bit for bit (non-reentrant checkpointing saves through its own hooks,
    inside the block, and recomputes under them in backward)."""
    x = torch.randn(16, 32)
    ref = step(fresh(p=0.0), x)
    packs = {}
    for k in (0, 2, 6):
        model = fresh(p=0.0)
        recompute_blocks(model, k)
        o, _ = offloader(min_bytes=0)
        loss, grads = step(model, x, hooks=o)
        st = o.iteration_end()
        assert torch.equal(loss, ref[0]) and all(torch.equal(g, r) for g, r in zip(grads, ref[1]))
        assert st["tensors_in"] == st["tensors_out"] and st["not_unpacked"] == 0
        packs[k] = st["tensors_out"]
    assert packs[0] > packs[2] > packs[6] > 0


def test_hugging_face_llama_recomputes_with_the_cache_off():
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         use_cache=True)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def run(k):
        torch.manual_seed(0)
        m = tf.LlamaForCausalLM(cfg).train()
        names = recompute_blocks(m, k)
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        return names, m.config.use_cache, loss.detach(), [p.grad.clone() for p in m.parameters()]

    _, _, ref_loss, ref_grads = run(0)
    names, cache, loss, grads = run(2)
    assert names == ["model.layers.2", "model.layers.3"] and cache is False
    assert torch.equal(loss, ref_loss) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


def test_exported_from_the_package():
    assert stweaver.recompute_blocks is recompute_blocks and "recompute_blocks" in stweaver.__all__
