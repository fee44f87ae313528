"""Block allocation: consecutive when possible, atomic on exhaustion, nothing moves."""

from __future__ import annotations

import random

import pytest
import torch

from declattn.engine import native
from declattn.engine.kv import KVCache, KVConfig, PoolExhausted


def make(num_blocks: int = 32, block_size: int = 4) -> KVCache:
    return KVCache(
        KVConfig(
            n_layers=2,
            n_kv_heads=2,
            head_dim=8,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=torch.float32,
        )
    )


def test_pool_layout_and_sizes() -> None:
    cache = make()
    assert cache.k[0].shape == (2, 32 * 4, 8)
    assert len(cache.k) == len(cache.v) == 2
    assert cache.bytes_per_block == 2 * 2 * 4 * 8 * 4
    bf16 = KVCache(KVConfig(1, 8, 128, 4, block_size=16))
    assert bf16.bytes_per_block == 2 * 8 * 16 * 128 * 2
    assert bf16.k[0].dtype == torch.bfloat16


def test_allocate_rounds_up_and_never_shrinks() -> None:
    cache = make()
    assert cache.allocate(1, 5) == (0, 1)
    assert cache.block_table(1) == (0, 1)
    assert cache.allocate(1, 8) == ()
    assert cache.allocate(1, 3) == ()
    assert cache.block_table(1) == (0, 1)
    assert cache.capacity(1) == 8
    assert cache.num_free_blocks == 30
    assert cache.blocks_in_use == 2


def test_growth_extends_in_place_when_successor_is_free() -> None:
    cache = make()
    cache.allocate(1, 4)
    cache.allocate(1, 9)
    cache.allocate(1, 16)
    assert cache.block_table(1) == (0, 1, 2, 3)


def test_interleaved_growth_keeps_tables_disjoint() -> None:
    cache = make(num_blocks=64)
    for total in range(4, 65, 4):
        cache.allocate(1, total)
        cache.allocate(2, total)
    for sid in (1, 2):
        table = cache.block_table(sid)
        assert len(table) == 16
        assert len(set(table)) == 16
    assert not set(cache.block_table(1)) & set(cache.block_table(2))
    # A fresh request for many blocks gets one run when a long enough free run exists.
    cache.allocate(3, 4 * 20)
    t3 = cache.block_table(3)
    assert list(t3) == list(range(t3[0], t3[0] + 20))


def test_best_fit_run_is_used_for_a_new_sequence() -> None:
    cache = make(num_blocks=20)
    cache.allocate(1, 4 * 3)  # 0..2
    cache.allocate(2, 4 * 2)  # 3..4
    cache.allocate(3, 4 * 6)  # 5..10
    cache.free(2)  # hole of 2 at 3..4, tail run 11..19
    cache.allocate(4, 4 * 2)
    assert cache.block_table(4) == (3, 4)


def test_fragmented_pool_still_serves_requests() -> None:
    cache = make(num_blocks=12)
    for sid in range(6):
        cache.allocate(sid, 8)
    for sid in (0, 2, 4):
        cache.free(sid)
    free_before = cache.num_free_blocks
    assert free_before == 6
    cache.allocate(9, 4 * 5)
    assert len(cache.block_table(9)) == 5
    assert cache.num_free_blocks == 1
    used = [b for s in cache.seq_ids for b in cache.block_table(s)]
    assert len(used) == len(set(used)) == 11


def test_exhaustion_is_atomic() -> None:
    cache = make(num_blocks=8)
    cache.allocate(1, 4 * 3)
    cache.allocate(2, 4 * 3)
    tables = {s: cache.block_table(s) for s in cache.seq_ids}
    free = cache.num_free_blocks
    with pytest.raises(PoolExhausted) as err:
        cache.allocate(1, 4 * 6)  # needs 3, 2 free
    assert err.value.needed == 3 and err.value.free == 2
    assert "3 blocks needed" in str(err.value) and "2 free" in str(err.value)
    with pytest.raises(PoolExhausted):
        cache.allocate(7, 4 * 3)  # a new sequence: must not be registered either
    assert {s: cache.block_table(s) for s in cache.seq_ids} == tables
    assert cache.num_free_blocks == free
    assert 7 not in cache.seq_ids
    cache.allocate(1, 4 * 5)  # exactly what is left still works
    assert cache.num_free_blocks == 0


def test_free_returns_blocks_and_they_are_reused() -> None:
    cache = make(num_blocks=10)
    cache.allocate(1, 4 * 4)
    cache.allocate(2, 4 * 4)
    assert cache.free(1) == 4
    assert cache.free(1) == 0
    assert cache.block_table(1) == ()
    assert cache.num_free_blocks == 6
    cache.allocate(3, 4 * 6)
    assert cache.num_free_blocks == 0
    assert set(cache.block_table(3)) == set(range(10)) - set(cache.block_table(2))


def test_random_alloc_free_keeps_accounting_consistent() -> None:
    rng = random.Random(0)
    cache = make(num_blocks=40)
    lengths: dict[int, int] = {}
    for _ in range(400):
        sid = rng.randrange(6)
        if rng.random() < 0.2:
            cache.free(sid)
            lengths.pop(sid, None)
            continue
        total = lengths.get(sid, 0) + rng.randrange(1, 12)
        before = {s: cache.block_table(s) for s in cache.seq_ids}
        try:
            cache.allocate(sid, total)
            lengths[sid] = total
        except PoolExhausted:
            assert {s: cache.block_table(s) for s in cache.seq_ids} == before
            continue
        # Existing blocks never move.
        assert cache.block_table(sid)[: len(before.get(sid, ()))] == before.get(sid, ())
        used = [b for s in cache.seq_ids for b in cache.block_table(s)]
        assert len(used) == len(set(used)) == cache.blocks_in_use
        # the array the decode plans read, cached between changes, follows every change
        for s in range(6):
            assert cache.block_array(s).tolist() == list(cache.block_table(s))
        assert cache.blocks_in_use + cache.num_free_blocks == 40


def test_block_array_is_read_only() -> None:
    cache = make()
    cache.allocate(1, 9)
    with pytest.raises(ValueError, match="read-only"):
        cache.block_array(1)[0] = 5
    assert cache.block_table(1) == (0, 1, 2)


def test_slots_follow_the_block_table_and_write_stores_rows() -> None:
    cache = make(num_blocks=8)
    cache.allocate(1, 4)  # block 0
    cache.allocate(2, 4)  # block 1
    cache.allocate(1, 7)  # block 2 (1 is taken)
    assert cache.block_table(1) == (0, 2)
    assert cache.slots(1, 2, 7).tolist() == [2, 3, 8, 9, 10]
    with pytest.raises(ValueError):
        cache.slots(1, 0, 9)
    k = torch.randn(5, 2, 8)
    v = torch.randn(5, 2, 8)
    cache.write(1, cache.slots(1, 2, 7), k, v)
    assert torch.equal(cache.k[1][:, 8, :], k[2])
    assert torch.equal(cache.v[1][:, 3, :], v[1])
    assert torch.count_nonzero(cache.k[0]) == 0


@pytest.mark.parametrize("slots", [slice(5, 8), torch.tensor([5, 6, 7]), torch.tensor([7, 1, 4])],
                         ids=["slice", "consecutive", "apart"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_stored_natively_equal_the_torch_copy(dtype, slots) -> None:
    """``write`` goes through ``store_rows`` (kv_store.cpp) on CPU, rows consecutive or
    apart (a batch's new tokens, each in its sequence's block); the pools must hold what
    the torch copy stores, the rows of a strided ``v`` (a view of a merged projection's
    output, as the layer runner passes it) included."""
    if native.store_op() is None:
        pytest.skip("no native extension")
    caches = {}
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 2, 8, generator=g).to(dtype)
    v = torch.randn(3, 40, generator=g).to(dtype)[:, 8:24].view(3, 2, 8)  # strided rows
    for way in ("native", "torch"):
        cache = caches[way] = KVCache(KVConfig(2, 2, 8, 8, 4, dtype=dtype))
        if way == "torch":
            cache._store = None
        cache.write(1, slots, k, v)
    assert caches["native"]._store is not None
    for pools in ("k", "v"):
        native_pool, torch_pool = getattr(caches["native"], pools), getattr(caches["torch"], pools)
        assert all(torch.equal(a, b) for a, b in zip(native_pool, torch_pool, strict=True))
    rows = slots if isinstance(slots, torch.Tensor) else torch.arange(5, 8)
    assert torch.equal(caches["native"].v[1][:, rows].transpose(0, 1), v)


def test_store_rows_refuses_what_does_not_fit_its_pool() -> None:
    op = native.store_op()
    if op is None:
        pytest.skip("no native extension")
    kp, vp = torch.zeros(2, 8, 4), torch.zeros(2, 8, 4)
    k = torch.ones(3, 2, 4)
    rows = torch.tensor([5, 6, 7])
    with pytest.raises(RuntimeError, match="row 8 outside the pool's 8"):
        op(kp, vp, k, k, torch.tensor([6, 7, 8]))
    with pytest.raises(RuntimeError, match="one per new token"):
        op(kp, vp, k, k, torch.tensor([6, 7]))
    with pytest.raises(RuntimeError, match="one per new token"):
        op(kp, vp, k, k, rows.int())
    with pytest.raises(RuntimeError, match="differs from its pool in dtype"):
        op(kp, vp, k.bfloat16(), k, rows)
    with pytest.raises(RuntimeError, match=r"must be \[T, Hkv, D\]"):
        op(kp, vp, torch.ones(3, 1, 4), k, rows)
    assert torch.count_nonzero(kp) == 0 and torch.count_nonzero(vp) == 0  # nothing written
