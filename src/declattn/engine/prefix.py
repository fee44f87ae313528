"""Prefix caching for the engine's sequences: a new prompt starts on the cached blocks of
its longest cached prefix, and the prompt blocks it computes are addressed for later ones.

A cached prefix must give bit for bit what a fresh prefill gives, so what a block holds
must not depend on how the steps around it were cut. Prefill attention of a row depends
on where its piece of the prompt starts (the earlier context and the piece are summed
apart and merged), and the projections of a row do not depend on the other rows of the
call. So prompt positions are computed in pieces that start at fixed places, a grid
that depends only on the engine's settings (``Scheduler.piece``): whole multiples of the
prefill chunk, cut within a chunk at multiples of the per-step prefill budget. Sharing
stops at a multiple of the chunk, and the rest of the prompt is then computed in exactly
the pieces a fresh prefill uses. (The one prefill that starts off the grid, after
synthetic K/V, addresses nothing: ``PagedEngine.prefill_synthetic``.)
"""

from __future__ import annotations

from declattn.engine.blocks import block_digests
from declattn.engine.kv import KVCache
from declattn.engine.kvdisk.tier import DiskTier
from declattn.engine.models import ModelConfig
from declattn.engine.request import Request


class PromptCache:
    """Shares cached prompt prefixes with new sequences and addresses computed blocks;
    with a ``disk`` tier, goes on from disk where memory ends and writes whole chunks."""

    def __init__(
        self, cache: KVCache, config: ModelConfig, prefill_chunk: int,
        disk: DiskTier | None = None,
    ) -> None:
        self.cache = cache
        self.config = config
        self.prefill_chunk = prefill_chunk
        self.disk = disk

    def share(self, seq: Request, running: int) -> int:
        """Start ``seq`` on the cached blocks of its prompt's longest cached prefix, in
        memory and then on disk (leaving a block free for each of the ``running``
        sequences); returns the positions taken over.

        The shared part stops at a multiple of the prefill chunk below the prompt's last
        token: the rest is then prefilled in the pieces a fresh prefill would use, and
        the last token's logits are always computed, never taken from a cache.
        """
        if not self.cache.blocks.caching:
            return 0
        n, bs = len(seq.prompt_ids), self.cache.block_size
        regions = seq.controller.regions(0, n) if self.config.needs_token_context else None
        seq.digests = block_digests(seq.prompt_ids, regions, bs)
        usable = seq.digests[: (n - 1) // bs]  # the last prompt token is always computed
        shared = self.cache.share_prefix(seq.seq_id, usable, self.prefill_chunk // bs)
        if self.disk is not None:  # the disk tier goes on in whole chunks where memory ends
            room = self.cache.num_free_blocks - running
            shared += self.disk.restore(self.cache, seq, usable, shared, room)
        seq.prefilled = seq.registered = shared * bs
        return shared * bs

    def register(self, seq: Request) -> None:
        """Address the prompt blocks the last piece completed; a piece that completes a
        chunk hands the whole chunk to the disk tier (a piece never crosses a chunk's
        end, so it completes at most one)."""
        bs = self.cache.block_size
        full = min(seq.prefilled // bs, len(seq.digests))
        for index in range(seq.registered // bs, full):
            self.cache.register(seq.seq_id, index, seq.digests[index])
        seq.registered = max(seq.registered, full * bs)
        chunk = self.prefill_chunk
        if self.disk is not None and seq.prefilled and seq.prefilled % chunk == 0:
            self.disk.save(self.cache, seq, seq.prefilled - chunk, seq.prefilled)
