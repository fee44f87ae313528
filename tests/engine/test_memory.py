"""A KV pool that cannot fit the machine is refused when it is made, in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from declattn.engine.kv import KVCache, KVConfig
from declattn.engine.memory import available_bytes, check_fits


def test_available_bytes_reads_memavailable(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:  24000000 kB\nMemFree:  1000 kB\nMemAvailable:  2048 kB\n")
    assert available_bytes(info) == 2048 * 1024
    assert available_bytes(tmp_path / "missing") is None


def test_check_fits_names_the_need_and_the_fix(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemAvailable:  1048576 kB\n")  # 1 GiB
    check_fits("a thing", 2**29, "make it smaller", info)
    with pytest.raises(ValueError, match=r"a thing needs 2\.0 GiB, more than the 1\.0 GiB.*"
                       r"make it smaller"):
        check_fits("a thing", 2**31, "make it smaller", info)


def test_a_pool_larger_than_the_machine_is_refused_before_it_is_touched() -> None:
    free = available_bytes()
    if free is None:
        pytest.skip("no /proc/meminfo here")
    per_block = 2 * 8 * 128 * 4 * 16  # one layer's K+V of one block, fp32
    blocks = free // per_block + 1
    config = KVConfig(n_layers=1, n_kv_heads=8, head_dim=128, num_blocks=blocks,
                      block_size=16, dtype=torch.float32)
    assert config.pool_bytes > free
    with pytest.raises(ValueError, match=r"a KV pool of .* blocks of 16 tokens needs .* "
                       r"GiB, more than the .* GiB of memory available: ask for fewer"):
        KVCache(config)
