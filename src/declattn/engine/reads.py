"""What decode attention actually read: the evidence behind every DA saving.

Masking is not skipping: a saving counts only where fewer KV bytes are read. The
attention records, per decode row and layer, the logical blocks it gathered and the
bytes of K and V it touched, so tests can hold the reads against the scope exactly and
reports can count bytes rather than assume them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockRead:
    """What one decode row read in one layer call; ``blocks``: the logical blocks, sorted
    and unique (as ``RunPlan`` names them). ``row``: the row's place among its
    sequence's rows of the step (several where a forward carries forced tokens; they
    walk overlapping runs one after another, so the union of their rows is counted
    once, on row 0, and the other rows count none)."""

    step: int
    layer: int
    seq_id: int
    blocks: tuple[int, ...]
    n_bytes: int
    sliding: bool
    row: int = 0


@dataclass
class ReadCounter:
    """Blocks and bytes that decode attention actually sliced out of the pools.

    Global-layer reads (the ones a view restricts) and sliding-window reads are kept
    apart so a test can hold the global reads against the view exactly. ``n_bytes``
    counts K and V of the positions sliced; the unfilled tail of the newest block is
    not read and not counted.
    """

    records: list[BlockRead] = field(default_factory=list)
    n_steps: int = 0
    _index: dict[tuple[int, int, int, int, bool], list[BlockRead]] = field(
        default_factory=dict, repr=False
    )
    # (step, seq, sliding): the engine asks per sequence and step, and a scan of every
    # record for each sequence made a batched step quadratic in the batch
    _rows: dict[tuple[int, int, bool], list[BlockRead]] = field(
        default_factory=dict, repr=False
    )
    # (step, seq, row, sliding) -> bytes: what the engine asks of every decode row
    _row_bytes: dict[tuple[int, int, int, bool], int] = field(default_factory=dict, repr=False)

    def begin_step(self) -> int:
        """Open a new step and return its index (one per ``PagedAttention``)."""
        self.n_steps += 1
        return self.n_steps - 1

    def record(self, rec: BlockRead) -> None:
        self._add([rec], rec.step, rec.seq_id, rec.row, rec.sliding)

    def record_layers(
        self, layers: Sequence[int], step: int, seq_id: int, row: int,
        blocks: tuple[int, ...], n_bytes: int, sliding: bool,
    ) -> None:
        """One decode row's reads on each of ``layers``, the same ``blocks`` and
        ``n_bytes`` on every one (a plan those layers share): a ``BlockRead`` for each, as
        ``record`` would keep them, with the row's indexes updated once rather than per
        layer (a batched step records every row on every layer)."""
        recs = [
            BlockRead(step=step, layer=layer, seq_id=seq_id, blocks=blocks, n_bytes=n_bytes,
                      sliding=sliding, row=row)
            for layer in layers
        ]
        self._add(recs, step, seq_id, row, sliding)

    def _add(self, recs: list[BlockRead], step: int, seq_id: int, row: int,
             sliding: bool) -> None:
        """``recs``: reads of one row of one step, each on its own layer."""
        self.records.extend(recs)
        index = self._index
        for rec in recs:
            key = (step, seq_id, row, rec.layer, sliding)
            same = index.get(key)
            if same is None:
                index[key] = [rec]
            else:
                same.append(rec)
        self._rows.setdefault((step, seq_id, sliding), []).extend(recs)
        key_row = (step, seq_id, row, sliding)
        self._row_bytes[key_row] = self._row_bytes.get(key_row, 0) + sum(r.n_bytes for r in recs)

    def reset(self) -> None:
        self.records.clear()
        self._index.clear()
        self._rows.clear()
        self._row_bytes.clear()
        self.n_steps = 0

    def _select(
        self,
        *,
        sliding: bool,
        step: int | None = None,
        seq_id: int | None = None,
        layer: int | None = None,
        row: int | None = None,
    ) -> list[BlockRead]:
        pool = self.records
        if step is not None and seq_id is not None:
            pool = self._rows.get((step, seq_id, sliding), [])
        return [
            r
            for r in pool
            if r.sliding == sliding
            and (step is None or r.step == step)
            and (seq_id is None or r.seq_id == seq_id)
            and (layer is None or r.layer == layer)
            and (row is None or r.row == row)
        ]

    def blocks_read(
        self, step: int, seq_id: int, layer: int, *, sliding: bool = False, row: int = 0
    ) -> tuple[int, ...] | None:
        """Logical blocks one decode row read in one layer; ``None`` if it read nothing."""
        recs = self._index.get((step, seq_id, row, layer, sliding))
        if not recs:
            return None
        if len(recs) == 1:  # the usual case; a plan names its blocks sorted and unique
            return recs[0].blocks
        return tuple(sorted({b for r in recs for b in r.blocks}))

    def row_bytes(self, step: int, seq_id: int, row: int = 0, *, sliding: bool = False) -> int:
        """Bytes one decode row read in one step, over every layer (``total_bytes`` of the
        row, kept as records come in: the engine asks it of every row of every step)."""
        return self._row_bytes.get((step, seq_id, row, sliding), 0)

    def per_step(self, seq_id: int, *, sliding: bool = False) -> dict[int, dict[int, tuple]]:
        """``{step: {layer: blocks}}`` for one sequence."""
        out: dict[int, dict[int, tuple]] = {}
        for r in self._select(sliding=sliding, seq_id=seq_id):
            out.setdefault(r.step, {})[r.layer] = r.blocks
        return out

    def total_bytes(
        self,
        *,
        sliding: bool = False,
        seq_id: int | None = None,
        step: int | None = None,
        row: int | None = None,
    ) -> int:
        recs = self._select(sliding=sliding, seq_id=seq_id, step=step, row=row)
        return sum(r.n_bytes for r in recs)

    def total_blocks(
        self, *, sliding: bool = False, seq_id: int | None = None, step: int | None = None
    ) -> int:
        """Block reads summed over layers, rows and steps."""
        recs = self._select(sliding=sliding, seq_id=seq_id, step=step)
        return sum(len(r.blocks) for r in recs)

    def bytes_per_sequence(self, *, sliding: bool = False) -> dict[int, int]:
        out: dict[int, int] = {}
        for r in self._select(sliding=sliding):
            out[r.seq_id] = out.get(r.seq_id, 0) + r.n_bytes
        return out
