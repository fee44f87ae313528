"""Engines over the tiny test model with the disk tier in a temporary directory."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_world import Tok

from declattn.engine.controller import Controller, Forced
from declattn.engine.engine import PagedEngine
from declattn.engine.kvdisk.identity import model_identity
from declattn.engine.kvdisk.options import DiskOptions
from declattn.engine.kvdisk.store import STAMPS
from declattn.engine.models import Decoder
from declattn.engine.request import Request
from declattn.engine.sampler import SamplingParams

CHUNK = 64  # prefill chunk: the disk tier stores whole ones
BLOCK = 16


def options(model: Decoder, root: Path, max_bytes: int | None = None) -> DiskOptions:
    return DiskOptions("tiny", model_identity(model, None, root / STAMPS), root, max_bytes)


def engine(
    model: Decoder, root: Path | None, *, caching: bool = True, num_blocks: int = 256,
    max_bytes: int | None = None,
) -> PagedEngine:
    disk = options(model, root, max_bytes) if root is not None else None
    return PagedEngine(model, Tok(), num_blocks=num_blocks, block_size=BLOCK,
                       prefill_chunk=CHUNK, prefix_caching=caching, kv_disk=disk)


def run(eng: PagedEngine, ctl: Controller, n: int = 6) -> tuple[Request, list[torch.Tensor]]:
    """Run ``ctl``'s prompt for ``n`` greedy tokens; the request and each step's logits.
    Waits for the disk tier's writes, so the next engine sees them."""
    keep = Forced(ctl, [], keep_logits=True)
    seq = eng.add(keep, SamplingParams(max_tokens=n, ignore_eos=True))
    for _ in eng.run(seq):
        pass
    if eng.disk is not None:
        eng.disk.flush()
    return seq, keep.logits


def chunk_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.safetensors"))
