"""The StreamingLLM baseline as a tracked request: a sink and a recent window of blocks.

The evaluation's ``streaming`` arm reads, at every decode step, the blocks covering the
attention sink and the most recent blocks, a fixed budget in all (``eval.baselines``,
where our engine runs it). That is a block-table row like any other, so the builder
wrapper compacts it the way it compacts a DA row, and the read log holds what the kernel
was handed. It needs neither the output's text nor the layout: the blocks follow from the
step's length alone.

(Quest, the other sparse arm, cannot be expressed this way: it picks each step's blocks
from that step's query-key scores, inside attention.)
"""

from __future__ import annotations

from declattn.eval.baselines import sink_blocks, streaming_view
from declattn.vllm.tracker import Tracker
from declattn.vllm.xargs import StreamingSpec

MODE = "streaming"


class StreamingTracker(Tracker):
    """Each decode step keeps ``spec.budget`` blocks: the sink's and the newest ones."""

    follows_output = False

    def __init__(self, spec: StreamingSpec) -> None:
        super().__init__(spec.label, True, spec.prompt_len)
        self.spec = spec

    def kept_blocks(self, length: int, block_size: int) -> tuple[int, ...]:
        n_blocks = -(-length // block_size)
        sink = sink_blocks(self.spec.sink_tokens, block_size)
        return tuple(streaming_view(n_blocks, self.spec.budget, sink))

    def _describe(self, length: int, block_size: int) -> tuple[str, tuple[int, ...],
                                                                tuple[int, ...]]:
        return MODE, (), self.kept_blocks(length, block_size)
