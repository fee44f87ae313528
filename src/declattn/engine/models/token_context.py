"""What the ``declattn_tiny`` family needs to know about each token besides its id.

Two learning aids make a tiny model learn a lookup within minutes on a CPU (a plain
4-layer model sat on a loss plateau): each token's input also gets learned projections
of the previous ``token_shift`` tokens' embeddings (a ready-made "previous token" signal,
which induction otherwise has to discover), and each chunk token gets its chunk id's
embedding. Neither may cross a region boundary (a chunk, the question window, the
response), so a chunk's tokens look the same wherever the chunk sits. The engine and
the trainer both build this from ``Layout.regions``, so they cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenContext:
    previous: Tensor  # [T, shift] ids of the previous tokens, -1 across a region boundary
    segments: Tensor  # [T] chunk id of each token (0 outside chunks)

    @staticmethod
    def cat(parts: Sequence[TokenContext]) -> TokenContext:
        """The contexts of several sequences, in batch order (as their tokens are)."""
        return TokenContext(
            torch.cat([c.previous for c in parts]), torch.cat([c.segments for c in parts])
        )


def token_context(
    ids: Sequence[int],
    regions: Sequence[int],
    positions: Sequence[int],
    shift: int,
    offset: int = 0,
    device: torch.device | str = "cpu",
) -> TokenContext:
    """The context of ``positions``; ``ids[i]`` and ``regions[i]`` describe position
    ``offset + i`` and must cover ``shift`` positions before the first one asked."""
    prev = []
    segs = []
    for p in positions:
        i = p - offset
        r = regions[i]
        row = []
        for j in range(1, shift + 1):
            ok = p - j >= 0 and i - j >= 0 and regions[i - j] == r
            row.append(ids[i - j] if ok else -1)
        prev.append(row)
        segs.append(max(r, 0))
    return TokenContext(
        torch.tensor(prev, dtype=torch.long, device=device).view(len(positions), shift),
        torch.tensor(segs, dtype=torch.long, device=device),
    )
