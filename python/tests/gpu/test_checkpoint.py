"""Pool checkpoints under stweaver, called directly as CUDA graph trees call them:
torch._C._cuda_getCheckpointState(device, pool) and
torch._C._cuda_setCheckpointPoolState(device, state, stale_storages, storages_to_add_deleters).

What is checked (on a torch.cuda.MemPool, a private pool like the trees' graph pool):
- a restore frees every block live in the pool and re-creates the checkpoint's blocks at
  their addresses: checkpointed tensors keep their address and bytes, stale storages lose
  their deleter (dying frees nothing twice), blocks dead since the checkpoint come back
  allocated and are freed by raw_delete, a storage without deleter (what a graph replay
  makes) receives the block's DataPtr with stweaver's deleter;
- checkPoolLiveAllocations agrees after every restore, memory_allocated is exact, and no
  free ever fails (stweaver.stats()["failed_frees"]);
- a block used on another stream (record_stream) is waited for, not reused early.
"""

import gc

import pytest
import torch

import stweaver

MIB = 1 << 20


def _dev():
    return torch.cuda.current_device()


def _live(pool, ptrs):
    return torch._C._cuda_checkPoolLiveAllocations(_dev(), pool.id, set(ptrs))


def _failed_frees():
    gc.collect()  # no garbage of earlier tests freed in the middle of a measurement
    return stweaver.stats()["failed_frees"]


def _get(pool):
    return torch._C._cuda_getCheckpointState(_dev(), pool.id)


def _set(state, stale=(), add=()):
    torch._C._cuda_setCheckpointPoolState(_dev(), state, list(stale), list(add))


def test_restore_frees_stale_blocks_and_keeps_checkpointed_ones(metric):
    failed = _failed_frees()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        value = torch.full((4 * MIB,), 5, dtype=torch.uint8, device="cuda")
    vp = value.data_ptr()
    state = _get(pool)
    base = torch.cuda.memory_allocated()
    for size in (12 * MIB, 8 * MIB):
        with torch.cuda.use_mem_pool(pool):
            stale = torch.empty(size, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_allocated() == base + size
        assert _live(pool, [vp, stale.data_ptr()])
        _set(state, stale=[stale.untyped_storage()._cdata])
        # value's block was freed and re-created where it was; stale's block is gone.
        assert value.data_ptr() == vp
        assert bool((value == 5).all().item())
        assert _live(pool, [vp])
        assert torch.cuda.memory_allocated() == base
        del stale  # its deleter was removed: nothing is freed twice
        assert torch.cuda.memory_allocated() == base
    metric("allocated_after_restores", torch.cuda.memory_allocated() - base)
    del value
    assert _live(pool, [])
    assert _failed_frees() == failed
    del pool


def test_blocks_dead_since_the_checkpoint_come_back_until_raw_delete(metric):
    failed = _failed_frees()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        a = torch.ones(MIB, device="cuda")
        b = torch.full((2 * MIB,), 3.0, device="cuda")
    ap, bp = a.data_ptr(), b.data_ptr()
    state = _get(pool)
    base = torch.cuda.memory_allocated()
    del b  # dies after the checkpoint (as a graph output nobody kept)
    assert _live(pool, [ap])
    assert torch.cuda.memory_allocated() == base - 8 * MIB
    _set(state)
    # b's block is allocated again (its DataPtr was released: nobody owns it yet).
    assert _live(pool, [ap, bp])
    assert torch.cuda.memory_allocated() == base
    torch._C._cuda_cudaCachingAllocator_raw_delete(bp)
    assert _live(pool, [ap])
    assert torch.cuda.memory_allocated() == base - 8 * MIB
    # The trees' case: a replay re-created b's tensor over a storage without deleter; the
    # restore gives that storage the block's DataPtr, with stweaver's deleter.
    if hasattr(torch._C, "_construct_storage_from_data_pointer"):
        bs = torch._C._construct_storage_from_data_pointer(bp, a.device, 8 * MIB)
        _set(state, add=[bs._cdata])
        assert _live(pool, [ap, bp])
        assert torch._C._has_Standard_Deleter(bs._cdata)
        metric("storage_got_deleter", True)
        del bs  # frees b's block through stweaver's deleter
        assert _live(pool, [ap])
    assert bool((a == 1).all().item())
    del a
    assert _live(pool, [])
    assert torch.cuda.memory_allocated() == base - 12 * MIB
    assert _failed_frees() == failed
    del pool


def test_restore_waits_for_other_streams(metric):
    failed = _failed_frees()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        c = torch.full((4 * MIB,), 1.0, device="cuda")
    cp = c.data_ptr()
    state = _get(pool)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        c.add_(1.0)
    c.record_stream(side)
    before = torch.cuda.memory_stats()["num_sync_all_streams"]
    _set(state)  # c's block is freed (used on `side`: waited for) and re-created
    metric("syncs", torch.cuda.memory_stats()["num_sync_all_streams"] - before)
    assert c.data_ptr() == cp
    assert _live(pool, [cp])
    torch.cuda.synchronize()
    assert bool((c == 2.0).all().item()), "the side stream's work on c was lost"
    del c
    assert _live(pool, [])
    assert _failed_frees() == failed
    del pool


def test_a_checkpoint_is_refused_on_another_device():
    gc.collect()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.ones(16, device="cuda")
    state = _get(pool)
    with pytest.raises(RuntimeError, match="restored on device"):
        torch._C._cuda_setCheckpointPoolState(_dev() + 1, state, [], [])
    del x
    del pool
