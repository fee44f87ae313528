"""The block allocator: free, held and cached blocks; reference counts; LRU eviction.

The invariants, checked after every operation of random programs: each block is in
exactly one state; a held block is never handed out again or evicted; what allocation
can get is exactly free plus cached-idle blocks, and ``PoolExhausted`` is raised exactly
when a request needs more than that.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from declattn.engine.blocks import BlockAllocator, PoolExhausted, block_digests


def digest(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_take_release_and_reuse_through_the_cache() -> None:
    a = BlockAllocator(8)
    held = a.take(3, None)
    assert held == [0, 1, 2] and a.n_free == 5 and a.n_available == 5
    for i, b in enumerate(held):
        a.register(b, digest(i))
    a.release(held)
    assert a.n_free == 5 and a.n_cached_idle == 3 and a.n_available == 8  # kept, evictable
    assert a.cached_prefix([digest(0), digest(1), digest(9), digest(2)]) == 2  # stops at a miss
    assert a.refs(0) == 0  # looking references nothing
    shared = a.share([digest(0), digest(1)])
    assert shared == [0, 1] and a.refs(0) == a.refs(1) == 1 and a.n_cached_idle == 1
    again = a.share([digest(0)])
    assert again == [0] and a.refs(0) == 2  # two sequences hold it now


def test_eviction_is_least_recently_used_and_spares_held_blocks() -> None:
    a = BlockAllocator(4)
    blocks = a.take(4, None)
    for i, b in enumerate(blocks):
        a.register(b, digest(i))
    a.release([blocks[2]])
    a.release([blocks[0]])  # idle order now: 2, then 0
    got = a.take(1, None)
    assert got == [2] and not a.is_cached(2)  # the older one went first
    assert a.cached_prefix([digest(2)]) == 0
    assert a.is_cached(0) and a.refs(1) == a.refs(3) == 1
    with pytest.raises(PoolExhausted, match="2 blocks needed, 1 free"):
        a.take(2, None)  # only block 0 is available; nothing changed
    assert a.is_cached(0) and a.n_available == 1


def test_a_digest_cached_twice_keeps_its_first_block() -> None:
    a = BlockAllocator(4)
    x, y = a.take(2, None)
    a.register(x, digest(7))
    a.register(y, digest(7))  # computed the same prefix at the same time
    a.release([x, y])
    assert a.is_cached(x) and not a.is_cached(y) and a.n_free == 3


def test_caching_off_shares_nothing() -> None:
    a = BlockAllocator(4, caching=False)
    (b,) = a.take(1, None)
    a.register(b, digest(1))
    a.release([b])
    assert a.cached_prefix([digest(1)]) == 0 and a.n_free == 4


def test_digests_chain_and_cover_regions() -> None:
    ids = list(range(40))
    d = block_digests(ids, None, 16)
    assert len(d) == 2  # only full blocks
    assert block_digests(ids[:16], None, 16) == d[:1]
    other = block_digests([99, *ids[1:]], None, 16)
    assert other[0] != d[0] and other[1] != d[1]  # a block's address names its whole prefix
    regions = block_digests(ids, [0] * 40, 16)
    assert regions != block_digests(ids, [1] * 40, 16)
    assert block_digests(ids[:15], None, 16) == []


ops = st.lists(
    st.tuples(st.sampled_from(["take", "release", "share", "register"]), st.integers(0, 7)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_programs_keep_the_invariants(program: list[tuple[str, int]]) -> None:
    n = 8
    a = BlockAllocator(n)
    held: list[list[int]] = []  # one list per simulated sequence
    for op, k in program:
        if op == "take":
            want = 1 + k % 3
            if want > a.n_available:
                with pytest.raises(PoolExhausted):
                    a.take(want, None)
                continue
            got = a.take(want, None)
            assert not {b for seq in held for b in seq} & set(got)  # never a held block
            held.append(got)
        elif op == "release" and held:
            a.release(held.pop(k % len(held)))
        elif op == "share":
            chain = [digest(i) for i in range(k)]
            got = a.share(chain[: a.cached_prefix(chain)])
            if got:
                held.append(got)
        elif op == "register" and held:
            seq = held[k % len(held)]
            a.register(seq[0], digest(k % 4))
        refs = [0] * n
        for seq in held:
            for b in seq:
                refs[b] += 1
        assert [a.refs(b) for b in range(n)] == refs
        idle = sum(1 for b in range(n) if refs[b] == 0 and a.is_cached(b))
        free = sum(1 for b in range(n) if refs[b] == 0 and not a.is_cached(b))
        assert (a.n_cached_idle, a.n_free, a.n_available) == (idle, free, idle + free)
