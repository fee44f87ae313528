"""Forced tokens (jump-forward): tokens a controller fixes are appended without sampling
and computed in the sequence's next forward, one row each (fp32, tiny model).

- the output and the sampled tokens' logits are those of step-by-step decoding that
  forces the same tokens (teacher forcing, ``Forced``);
- each row reads its own view up to its own position (the read counter == the view,
  row by row), the pool rows the rows read together count once, and each row has its
  ``StepRead``;
- token healing takes the newest sampled token back and reports only the new text;
- EOS, a stop string and ``max_tokens`` inside forced tokens finish the sequence there.
"""

from __future__ import annotations

import pytest
import torch
from tiny_world import Tok, prompt, tiny_model

from declattn.engine.controller import Controller, Forced, ForcedTokens
from declattn.engine.engine import PagedEngine
from declattn.engine.sampler import SamplingParams

BS = 16


def engine(model, **kw) -> PagedEngine:
    return PagedEngine(model, Tok(), num_blocks=256, block_size=BS, prefill_chunk=64, **kw)


class Narrowing(Controller):
    """A DA-like view: everything for the first steps, then the first and newest blocks
    (so rows of one forward can read different views); keeps every view and logits."""

    def __init__(self, ids: list[int], narrow_after: int = 3) -> None:
        super().__init__(ids)
        self.narrow_after = narrow_after
        self.views: list[tuple[int, ...] | None] = []
        self.seen: list[tuple[int, str]] = []
        self.logits: list[torch.Tensor] = []

    def view(self, length: int):
        tokens = len(self.seen)
        view = None if tokens < self.narrow_after else tuple(sorted({0, (length - 1) // BS}))
        self.views.append(view)
        return view

    def process_logits(self, logits):
        self.logits.append(logits.clone())
        return logits

    def on_token(self, token_id: int, text: str):
        self.seen.append((token_id, text))
        return None


class Forcing(Narrowing):
    """Forces ``script[k]`` after its ``k``-th sampled token (counting from 0)."""

    def __init__(self, ids: list[int], script: dict[int, ForcedTokens], **kw) -> None:
        super().__init__(ids, **kw)
        self.script = script
        self.sampled = 0
        self.asked = 0
        self._next: ForcedTokens | None = None
        self.forced_ids: list[int] = []

    def process_logits(self, logits):
        out = super().process_logits(logits)
        self._next = self.script.get(self.sampled)
        self.sampled += 1
        return out

    def forced(self):
        self.asked += 1
        out, self._next = self._next, None
        if out is not None:
            self.forced_ids.extend(out.tokens)
        return out


def run(eng: PagedEngine, ctl: Controller, n: int, **params):
    seq = eng.add(ctl, SamplingParams(max_tokens=n, ignore_eos=True, **params))
    events = []
    while seq.finish_reason is None:
        events += [e for e in eng.step() if e.seq_id == seq.seq_id]
    return seq, events


SCRIPT = {0: ForcedTokens((7, 8, 9)), 4: ForcedTokens((3,)), 5: ForcedTokens((11, 12, 13, 14))}


def test_forced_rows_equal_step_by_step_decoding_that_forces_them() -> None:
    model = tiny_model(seed=21)
    ids = prompt(100, 3)
    ctl = Forcing(ids, SCRIPT)
    seq, events = run(engine(model), ctl, 24)
    out = seq.output_ids
    assert seq.finish_reason == "length" and len(out) == 24
    assert [e.token_id for e in events] == out  # every token reported, forced ones too
    for at, f in ((1, (7, 8, 9)), (8, (3,)), (10, (11, 12, 13, 14))):
        assert tuple(out[at : at + len(f)]) == f
    # teacher forcing: the same tokens, one decode step each, no forcing
    teacher = Forced(Narrowing(ids), out, keep_logits=True)
    ref, _ = run(engine(model, forcing=False), teacher, 24)
    assert ref.output_ids == out
    sampled = [i for i in range(24) if i not in (1, 2, 3, 8, 10, 11, 12, 13)]
    assert len(ctl.logits) == len(sampled)
    for got, i in zip(ctl.logits, sampled, strict=True):
        torch.testing.assert_close(got, teacher.logits[i], rtol=1e-4, atol=1e-4)
    # one read per row that ran, every row's views as the controller gave them
    assert len(seq.reads) == len(ref.reads) == 23
    assert ctl.views == teacher.inner.views
    full = [tuple(range(-(-r.length // BS))) for r in seq.reads]
    expected = [v if v is not None else f for v, f in zip(ctl.views, full, strict=True)]
    assert [r.blocks for r in seq.reads] == expected == [r.blocks for r in ref.reads]
    assert all(r.layers_agree for r in seq.reads)
    forwards = [r for r in seq.reads if not r.forced]
    assert len(forwards) == 23 - 8  # eight forced tokens computed beside other rows


def test_forced_rows_count_the_kv_they_read_together_once() -> None:
    """The rows of a forward read the union of their positions: its bytes are on the
    first row and fall short of what the rows read one step each."""
    model = tiny_model(seed=22)
    ids = prompt(150, 4)
    script = {3: ForcedTokens((5, 6, 7, 8, 9))}
    seq, _ = run(engine(model), Forcing(ids, script, narrow_after=2), 10)
    ref, _ = run(engine(model, forcing=False), Forced(Narrowing(ids, 2), seq.output_ids), 10)
    rows = [i for i, r in enumerate(seq.reads) if r.forced]
    assert len(rows) == 5
    first = rows[0]
    group = seq.reads[first : first + 6]  # five forced rows and the row that samples
    assert [r.global_bytes for r in group[1:]] == [0] * 5
    kv_per_token = seq.reads[0].global_bytes // seq.reads[0].length  # a full read, row 0
    # each block as far as the furthest row that reads it
    union = {b: max(min(BS, r.length - b * BS) for r in group if b in r.blocks)
             for b in {b for r in group for b in r.blocks}}
    assert group[0].global_bytes == sum(union.values()) * kv_per_token
    step_by_step = sum(r.global_bytes for r in ref.reads[first : first + 6])
    assert group[0].global_bytes < step_by_step


def test_rows_that_read_everything_count_the_sequence_once() -> None:
    """Rows that read everything (vanilla) count every position once, as a causal
    prefill over the sequence would."""
    model = tiny_model(seed=23)
    ids = prompt(70, 5)

    class Vanilla(Forcing):
        def view(self, length):
            self.views.append(None)
            return None

    ctl = Vanilla(ids, {1: ForcedTokens((40, 41, 42))})
    seq, _ = run(engine(model), ctl, 8)
    teacher = Forced(Narrowing(ids, 99), seq.output_ids, keep_logits=True)
    ref, _ = run(engine(model, forcing=False), teacher, 8)
    assert ref.output_ids == seq.output_ids
    sampled = [0, 1, 5, 6, 7]
    for got, i in zip(ctl.logits, sampled, strict=True):
        torch.testing.assert_close(got, teacher.logits[i], rtol=1e-4, atol=1e-4)
    group = seq.reads[1:5]
    per_token = seq.reads[0].global_bytes // seq.reads[0].length
    assert group[0].global_bytes == group[-1].length * per_token


HEALED = 500


class HealTok(Tok):
    """Id ``HEALED`` decodes to ``healed + "!"``: ``[HEALED]`` heals a token whose text is
    ``healed``, and adds the text ``!``."""

    def __init__(self, healed: str) -> None:
        self.healed = healed

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.healed + "!" if i == HEALED else Tok.decode(self, [i]) for i in ids)


def test_healing_replaces_the_newest_sampled_token() -> None:
    model = tiny_model(seed=24)
    ids = prompt(60, 6)
    plain, _ = run(engine(model), Controller(ids), 3)
    first, second = plain.output_ids[:2]
    tok = HealTok(Tok().decode([second]))

    class Healing(Forcing):
        def forced(self):
            if self.sampled == 2 and not self.forced_ids:
                self.forced_ids = [HEALED, 17]
                return ForcedTokens((HEALED, 17), replaces_last=True)
            return None

    ctl = Healing(ids, {}, narrow_after=99)  # its count of tokens seen includes the taken-back
    seq, events = run(PagedEngine(model, tok, num_blocks=64, block_size=BS), ctl, 6)
    assert seq.output_ids[:3] == [first, HEALED, 17]
    # the sampled token was reported, then only the text healing added
    assert [e.text for e in events[:4]] == [tok.decode([first]), tok.decode([second]), "!",
                                            tok.decode([17])]
    assert [e.index for e in events[:4]] == [0, 1, 1, 2]
    assert seq.text == tok.decode(seq.output_ids)
    assert ctl.seen[2] == (HEALED, "!")
    teacher = Forced(Narrowing(ids, 99), seq.output_ids, keep_logits=True)
    ref, _ = run(PagedEngine(model, tok, num_blocks=64, block_size=BS, forcing=False),
                 teacher, 6)
    assert ref.output_ids == seq.output_ids
    torch.testing.assert_close(ctl.logits[2], teacher.logits[3], rtol=1e-4, atol=1e-4)


def test_healing_text_that_does_not_start_with_the_token_is_an_error() -> None:
    class Bad(Forcing):
        def forced(self):
            return ForcedTokens((HEALED,), replaces_last=True) if self.sampled else None

    model = tiny_model(seed=24)
    eng = PagedEngine(model, HealTok("?"), num_blocks=64, block_size=BS)
    seq = eng.add(Bad(prompt(20, 1), {}), SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match="does not start with"):
        while eng.has_work:
            eng.step()
    assert len(seq.output_ids) == 1  # the sampled token stays


def test_healing_before_the_first_token_is_an_error() -> None:
    class Bad(Forcing):
        def forced(self):
            return ForcedTokens((HEALED,), replaces_last=True)

    eng = PagedEngine(tiny_model(seed=24), HealTok("?"), num_blocks=64, block_size=BS)
    with pytest.raises(ValueError, match="a reply's start has none"):
        eng.add(Bad(prompt(20, 1), {}), SamplingParams(max_tokens=4, ignore_eos=True))


@pytest.mark.parametrize("rule", ["eos", "stop", "length"])
def test_finishing_rules_apply_inside_forced_tokens(rule: str) -> None:
    model = tiny_model(seed=25)
    ids = prompt(40, 7)
    forced = ForcedTokens((30, 31, 32, 33))
    params: dict = {}
    max_tokens = 12
    eng = engine(model)
    if rule == "eos":
        eng.acceptor.eos = {32}
        params = {"ignore_eos": False}
    elif rule == "stop":
        params = {"stop": (Tok().decode([31, 32]),)}
    else:
        max_tokens = 3
    ctl = Forcing(ids, {0: forced})
    seq = eng.add(ctl, SamplingParams(max_tokens=max_tokens, **{"ignore_eos": True, **params}))
    while eng.has_work:
        eng.step()
    assert seq.finish_reason == rule
    first = seq.output_ids[0]
    expected = {"eos": [first, 30, 31, 32], "stop": [first, 30, 31, 32],
                "length": [first, 30, 31]}[rule]
    assert seq.output_ids == expected
    if rule == "stop":
        assert seq.text == Tok().decode([first, 30])
    assert seq.reads == [] and eng.cache.blocks_in_use == 0  # no forward after the finish
    # the views of rows that would run with the next forward, and no more, were asked for
    assert len(ctl.views) == {"eos": 2, "stop": 2, "length": 1}[rule]


def test_forcing_off_never_asks_the_controller() -> None:
    model = tiny_model(seed=26)
    ctl = Forcing(prompt(30, 8), SCRIPT)
    seq, _ = run(engine(model, forcing=False), ctl, 6)
    assert ctl.asked == 0 and ctl.forced_ids == [] and len(seq.reads) == 5


def test_preempted_sequences_with_forced_rows_resume_with_their_views(monkeypatch) -> None:
    """A pool too small for four sequences that force tokens: one preempted while forced
    rows wait recomputes what its rows had run, then runs the waiting rows with the views
    they were given: the tokens and reads each gives alone."""
    from declattn.engine.scheduler import Scheduler

    waiting_rows: list[int] = []
    preempt = Scheduler.preempt

    def spy(self, seq):
        waiting_rows.append(len(seq.pending_views))
        preempt(self, seq)

    monkeypatch.setattr(Scheduler, "preempt", spy)
    model = tiny_model(seed=27)
    script = {k: ForcedTokens((100 + k, 200 + k, 300 + k)) for k in range(0, 60, 2)}
    prompts = [prompt(60 + 7 * i, 30 + i) for i in range(4)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)

    def run_all(num_blocks: int, batch: list[list[int]]):
        eng = PagedEngine(model, Tok(), num_blocks=num_blocks, block_size=BS, prefill_chunk=64)
        seqs = [eng.add(Forcing(p, script), params) for p in batch]
        while eng.has_work:
            eng.step()
        return seqs

    alone = [run_all(64, [p])[0] for p in prompts]
    assert waiting_rows == []
    together = run_all(14, prompts)
    assert max(waiting_rows) > 0  # preempted with forced rows waiting
    assert [s.output_ids for s in together] == [s.output_ids for s in alone]
    assert [[r.blocks for r in s.reads] for s in together] == [
        [r.blocks for r in s.reads] for s in alone]


class Opening(Narrowing):
    """Forces ``opening`` before its first sample (a reply's fixed start), nothing after."""

    def __init__(self, ids: list[int], opening: tuple[int, ...], **kw) -> None:
        super().__init__(ids, **kw)
        self.opening = opening
        self.asked = 0

    def forced(self):
        self.asked += 1
        return ForcedTokens(self.opening) if self.asked == 1 else None


def test_tokens_forced_before_the_first_sample_ride_the_prompts_last_forward() -> None:
    model = tiny_model(seed=26)
    ids = prompt(100, 8)
    ctl = Opening(ids, (7, 8, 9))
    seq, events = run(engine(model), ctl, 10)
    assert seq.output_ids[:3] == [7, 8, 9]
    assert [e.token_id for e in events] == seq.output_ids  # reported first, in order
    teacher = Forced(Narrowing(ids), seq.output_ids, keep_logits=True)
    ref, _ = run(engine(model, forcing=False), teacher, 10)
    assert ref.output_ids == seq.output_ids
    assert len(ctl.logits) == 7  # the prompt's own logits are not sampled from
    for got, i in zip(ctl.logits, range(3, 10), strict=True):
        torch.testing.assert_close(got, teacher.logits[i], rtol=1e-4, atol=1e-4)
    # each row read the view its controller gave; the three opening rows ran in the
    # forward that completed the prompt, so they are no decode forward of their own
    assert ctl.views == teacher.inner.views
    assert [r.blocks for r in seq.reads] == [r.blocks for r in ref.reads]
    assert [r.forced for r in seq.reads[:3]] == [True] * 3
    assert sum(not r.forced for r in seq.reads) == len(ref.reads) - 3


def test_an_opening_that_finishes_the_reply_reports_it_and_frees_its_blocks() -> None:
    eng = engine(tiny_model(seed=27))
    free = eng.cache.num_free_blocks
    seq, events = run(eng, Opening(prompt(40, 9), (7, 8, 9)), 2)
    assert seq.finish_reason == "length" and seq.output_ids == [7, 8]
    assert [e.token_id for e in events] == [7, 8] and events[-1].finish_reason == "length"
    assert not eng.has_work and eng.cache.num_free_blocks == free


def test_an_opening_beside_a_running_sequence_changes_neither_text() -> None:
    model = tiny_model(seed=28)
    a_ids, b_ids = prompt(90, 10), prompt(70, 11)
    alone_a, _ = run(engine(model), Controller(a_ids), 12)
    alone_b, _ = run(engine(model), Opening(b_ids, (5, 6)), 8)
    eng = engine(model)
    a = eng.add(Controller(a_ids), SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in range(4):
        eng.step()
    b = eng.add(Opening(b_ids, (5, 6)), SamplingParams(max_tokens=8, ignore_eos=True))
    while eng.has_work:
        eng.step()
    assert a.output_ids == alone_a.output_ids and b.output_ids == alone_b.output_ids
    assert b.output_ids[:2] == [5, 6]


def test_a_controller_that_selects_blocks_cannot_force_its_start() -> None:
    class Selecting(Opening):
        selects_blocks = True

    eng = engine(tiny_model(seed=29))
    with pytest.raises(ValueError, match="selects blocks by query cannot force"):
        eng.add(Selecting(prompt(30, 12), (7,)), SamplingParams(max_tokens=4, ignore_eos=True))


def test_an_opening_after_a_one_row_last_piece() -> None:
    """A prompt whose last piece is one row (65 tokens, pieces of 64): that row is a
    prefill row, and the opening's rows ride the same forward."""
    model = tiny_model(seed=30)
    ids = prompt(65, 13)
    seq, _ = run(engine(model), Opening(ids, (7, 8)), 6)
    ref, _ = run(engine(model, forcing=False), Forced(Narrowing(ids), seq.output_ids), 6)
    assert seq.output_ids[:2] == [7, 8] and ref.output_ids == seq.output_ids
    assert [r.blocks for r in seq.reads] == [r.blocks for r in ref.reads]
