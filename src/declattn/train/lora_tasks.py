"""Training documents and questions for a real model learning to declare (``da-lora``).

Every document comes from the *training* part of the packaged corpora (``corpora/split.py``:
essays, SQuAD articles and HotpotQA paragraphs the evaluation never reads), and every
invented fact from templates and name pools of this module, none of the evaluation's
(``corpora/essays.planted_fact`` and the task generators): the model learns the protocol,
not the test items. A ``Case`` is a context (or an agent transcript) with questions on
it; each question says which text holds its evidence, and ``targets.py`` writes the
reply once the context is cut into chunks.

Kinds (``KINDS``): ``planted`` (invented facts in essay prose), ``needle`` (RULER-style
needles, several keys, in essays or noise), ``squad`` (a SQuAD paragraph among
distractor paragraphs), ``hotpot`` (two supporting paragraphs among distractors: two
hops), ``compare`` (two invented facts compared), ``bridge`` (who holds a post, then a
fact about that person: two hops), ``agentic`` (tool results of
an agent's transcript with facts planted), ``survey`` (a count over the whole document:
the one kind answered from ``<global>`` notes).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from declattn.corpora.build import (
    TaskData,
    assemble,
    depths,
    fit,
    haystack,
    take_filler,
)

KINDS = ("planted", "needle", "squad", "hotpot", "compare", "bridge", "agentic", "survey")


@dataclass(frozen=True)
class Hop:
    """One focus of a reply: ``evidence`` occurs exactly once in the context, and the
    chunk holding it is the one to focus on. A first hop of two copies ``quote``."""

    evidence: str
    quote: str = ""


@dataclass(frozen=True)
class Question:
    kind: str
    question: str
    answer: str
    hops: tuple[Hop, ...]  # one or two; none for a survey
    notes: str = ""  # a survey's ``<global>`` notes


@dataclass(frozen=True)
class Case:
    """A document (``context``) or an agent transcript (``messages``, the question
    then follows as the last user message) and the questions asked on it, in order."""

    kind: str
    questions: tuple[Question, ...]
    context: str = ""
    messages: tuple[dict[str, Any], ...] = ()
    sources: tuple[str, ...] = field(default=())  # corpus identities read (split.py)


# --- invented names and facts ------------------------------------------------------------

_ONSETS = ("b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s",
           "st", "t", "th", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "oa", "ie")
_CODAS = ("", "", "n", "l", "r", "s", "th", "ck", "m", "x", "nd", "rt")


def _word(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
             for _ in range(syllables)]
    return "".join(parts).capitalize()


def person(rng: random.Random) -> str:
    return f"{_word(rng, rng.randint(1, 2))} {_word(rng, 2)}"


def place(rng: random.Random) -> str:
    return _word(rng, 2) + rng.choice(("ford", "by", "wick", "stead", "mouth", "ton", "field"))


_THINGS = ("lantern", "kettle", "compass", "ledger", "telescope", "sundial", "loom", "anvil")
_DEPOTS = ("tram", "freight", "postal", "river", "coach", "signal")
_BLENDS = ("Amber Dusk", "Quiet Harbour", "Copper Leaf", "Winter Orchard", "Saltbush",
           "Red Lantern", "Morning Fog", "Velvet Pine")
_CLUBS = ("bowls club", "cricket eleven", "brass band", "netball side", "rowing crew")
_PLANTS = ("tomatoes", "orchids", "chillies", "basil", "cucumbers", "figs", "lettuce")
_UNITS = ("centimetres", "kilograms", "metres")


def _n(rng: random.Random, lo: int, hi: int) -> str:
    return str(rng.randint(lo, hi))


def _clock(rng: random.Random) -> str:
    return f"{rng.randint(1, 12)}:{rng.choice(('05', '15', '20', '35', '40', '55'))} " \
           f"{rng.choice(('am', 'pm'))}"


FactMaker = Callable[[random.Random], tuple[str, str, str]]


def _locker(r: random.Random) -> tuple[str, str, str]:
    who, depot, n = person(r), r.choice(_DEPOTS), _n(r, 10, 999)
    return (f"The locker assigned to {who} at the {depot} depot is number {n}.",
            f"What locker number is assigned to {who} at the {depot} depot?", n)


def _tea(r: random.Random) -> tuple[str, str, str]:
    who, blend = person(r), r.choice(_BLENDS)
    return (f"{who}'s favourite tea blend is called {blend}.",
            f"What is {who}'s favourite tea blend called?", blend)


def _bus(r: random.Random) -> tuple[str, str, str]:
    a, b, t = place(r), place(r), _clock(r)
    return (f"The night bus from {a} to {b} leaves at {t}.",
            f"When does the night bus from {a} to {b} leave?", t)


def _glider(r: random.Random) -> tuple[str, str, str]:
    who, n = person(r), _n(r, 40, 400)
    return (f"The model glider built by {who} has a wingspan of {n} centimetres.",
            f"What is the wingspan of the model glider built by {who}?", f"{n} centimetres")


def _vault(r: random.Random) -> tuple[str, str, str]:
    bank, word = f"{_word(r, 2)} Savings", _word(r, 3).lower()
    return (f"The vault at {bank} opens with the word {word}.",
            f"Which word opens the vault at {bank}?", word)


def _cup(r: random.Random) -> tuple[str, str, str]:
    club, town, year = r.choice(_CLUBS), place(r), _n(r, 1890, 2015)
    return (f"In {year}, the {club} of {town} won the regional cup.",
            f"In which year did the {club} of {town} win the regional cup?", year)


def _greenhouse(r: random.Random) -> tuple[str, str, str]:
    street, plant = f"{_word(r, 2)} Street", r.choice(_PLANTS)
    return (f"The greenhouse on {street} grows mostly {plant}.",
            f"What does the greenhouse on {street} mostly grow?", plant)


def _thing(r: random.Random) -> tuple[str, str, str]:
    who, thing, colour = person(r), r.choice(_THINGS), r.choice(
        ("teal", "ochre", "crimson", "ivory", "slate grey", "mustard"))
    return (f"The {thing} that {who} inherited is painted {colour}.",
            f"What colour is the {thing} that {who} inherited?", colour)


FACTS: tuple[FactMaker, ...] = (_locker, _tea, _bus, _glider, _vault, _cup, _greenhouse, _thing)


def _facts(rng: random.Random, n: int) -> list[tuple[str, str, str]]:
    """``n`` facts with distinct questions whose answers no other fact spells."""
    out: list[tuple[str, str, str]] = []
    while len(out) < n:
        f = rng.choice(FACTS)(rng)
        if all(f[1] != o[1] and f[2].lower() not in o[0].lower()
               and o[2].lower() not in f[0].lower() for o in out):
            out.append(f)
    return out


def _once(text: str, needles: Sequence[str]) -> bool:
    low = text.lower()
    return all(low.count(n.lower()) == 1 for n in needles)


# --- generators -------------------------------------------------------------------------


def planted(data: TaskData, rng: random.Random, tokens: int) -> Case:
    facts = _facts(rng, rng.randint(1, 4))
    built = haystack(data, rng, tokens, [f[0] for f in facts], depths(rng, len(facts)), "essay")
    qs = [Question("planted", q, a, (Hop(f),)) for f, q, a in facts]
    rng.shuffle(qs)
    return Case("planted", tuple(qs), context=built.context)


def _needle_key(rng: random.Random, data: TaskData) -> str:
    a, b = rng.sample(data.words, 2)
    return f"{a}-{b}"


def needle(data: TaskData, rng: random.Random, tokens: int) -> Case:
    uuid_ = rng.random() < 0.25
    noun = "UUID" if uuid_ else "number"
    keys: list[str] = []
    while len(keys) < rng.randint(1, 5):
        k = _needle_key(rng, data)
        if k not in keys:
            keys.append(k)
    values = []
    for _ in keys:
        values.append(
            "-".join(f"{rng.getrandbits(b):0{b // 4}x}" for b in (32, 16, 16, 16, 48))
            if uuid_ else _n(rng, 1_000_000, 9_999_999)
        )
    needles = [f"The special magic {noun} for {k} is: {v}." for k, v in zip(keys, values,
                                                                              strict=True)]
    filler = "noise" if rng.random() < 0.25 else "essay"
    built = haystack(data, rng, tokens, needles, depths(rng, len(needles)), filler)
    asked = rng.sample(range(len(keys)), rng.randint(1, min(2, len(keys))))
    qs = tuple(
        Question("needle",
                 f"What is the special magic {noun} for {keys[i]} mentioned in the provided "
                 "text?", values[i], (Hop(needles[i]),))
        for i in asked
    )
    return Case("needle", qs, context=built.context)


def _passage(title: str, text: str) -> str:
    return f"{' '.join(title.split())}\n{' '.join(text.split())}"


def _numbered(built_context: str) -> str:
    return "\n\n".join(f"Passage {i}: {p}" for i, p in enumerate(built_context.split("\n\n"), 1))


def _passages(data: TaskData, rng: random.Random, tokens: int, golds: list[str],
              pool: Iterator[str]) -> str:
    count = data.count
    sep = max(0, count("word\n\nword") - 2 * count("word"))
    head = count("Passage 10: ")
    gold_tokens = sum(count(g) + sep + head for g in golds)
    units = [p for _, p in zip(range(400), pool, strict=False)]
    at = depths(rng, len(golds))

    def make(budget: int) -> Any:
        chosen = take_filler(count, iter(units), max(0, budget - gold_tokens), sep + head)
        return assemble(chosen, golds, at, "\n\n")

    return _numbered(fit(count, tokens, make).context)


def squad(data: TaskData, rng: random.Random, tokens: int) -> Case:
    paras = [p for p in data.squad if p["qas"]]
    n = rng.randint(1, 3)
    golds = rng.sample(paras, n)
    titles = {g["title"] for g in golds}
    qs = []
    for g in golds:
        text = _passage(g["title"], g["context"])
        question, answers = rng.choice(g["qas"])
        inside = sorted((a for a in answers if a and a in text), key=len)
        if inside:
            qs.append(Question("squad", question, inside[0], (Hop(text),)))
    others = [p for p in data.squad if p["title"] not in titles]
    rng.shuffle(others)
    pool = (_passage(p["title"], p["context"]) for p in others)
    context = _passages(data, rng, tokens, [_passage(g["title"], g["context"]) for g in golds],
                        pool)
    return Case("squad", tuple(qs), context=context, sources=tuple(sorted(titles)))


def _sentences(entry: dict[str, Any], title: str) -> list[str]:
    return next(s for t, s in entry["context"] if t == title)


def hotpot(data: TaskData, rng: random.Random, tokens: int) -> Case:
    entries = data.hotpot
    while True:
        e = entries[rng.randrange(len(entries))]
        gold = list(dict.fromkeys(t for t, _ in e["supporting_facts"]))
        answer = e["answer"].strip()
        if answer.lower() in ("yes", "no") or len(gold) != 2:
            continue
        texts = {t: "".join(_sentences(e, t)) for t in gold}
        holders = [t for t in gold if answer in texts[t]]
        if e["type"] == "bridge" and len(holders) == 1:
            second = holders[0]
            first = next(t for t in gold if t != second)
        elif e["type"] == "comparison" and holders:
            first, second = gold
        else:
            continue
        ids = [i for t, i in e["supporting_facts"] if t == first]
        sents = _sentences(e, first)
        quote = " ".join(sents[i].strip() for i in ids if i < len(sents))
        if not quote or len(quote.split()) > 40:
            continue
        break
    golds = [_passage(t, texts[t]) for t in (first, second)]
    own = [_passage(t, "".join(s)) for t, s in e["context"] if t not in gold]

    def pool() -> Iterator[str]:
        yield from own
        while True:
            other = entries[rng.randrange(len(entries))]
            for t, s in other["context"]:
                if t not in gold:
                    yield _passage(t, "".join(s))

    context = _passages(data, rng, tokens, golds, pool())
    q = Question("hotpot", e["question"], answer, (Hop(golds[0], quote), Hop(golds[1])))
    return Case("hotpot", (q,), context=context, sources=tuple(gold))


_MEASURES = (
    ("The rope bridge at {name} is {n} metres long.",
     ("Which rope bridge is longer, the one at {a} or the one at {b}?",
      "Which is longer, the rope bridge at {a} or the rope bridge at {b}?"), True),
    ("The orchard of {name} has {n} apple trees.",
     ("Which orchard has more apple trees, {a} or {b}?",
      "Which has more apple trees, the orchard of {a} or the orchard of {b}?"), True),
    ("The clock tower in {name} was finished in {n}.",
     ("Which clock tower was finished earlier, the one in {a} or the one in {b}?",
      "Which was finished earlier, the clock tower in {a} or the clock tower in {b}?"), False),
    ("The harbour of {name} shelters {n} fishing boats.",
     ("Which harbour shelters more fishing boats, the one of {a} or the one of {b}?",
      "Which shelters more fishing boats, the harbour of {a} or the harbour of {b}?"), True),
)


def compare(data: TaskData, rng: random.Random, tokens: int) -> Case:
    fact, questions, more_wins = rng.choice(_MEASURES)
    question = rng.choice(questions)
    a, b = place(rng), place(rng)
    na, nb = rng.sample(range(1800, 1990) if "finished" in fact else range(12, 640), 2)
    fa, fb = fact.format(name=a, n=na), fact.format(name=b, n=nb)
    winner = a if (na > nb) == more_wins else b
    first, second = (fa, fb)
    built = haystack(data, rng, tokens, [fa, fb], depths(rng, 2), "essay")
    q = Question("compare", question.format(a=a, b=b), winner, (Hop(first, first), Hop(second)))
    return Case("compare", (q,), context=built.context)


_ROLES = ("harbour master", "head gardener", "chief archivist", "bell keeper", "ferry pilot")
_PETS = ("parrot", "tortoise", "greyhound", "goat", "cat", "ferret")


def bridge(data: TaskData, rng: random.Random, tokens: int) -> Case:
    """Two hops: who holds a post, then a fact about that person."""
    role, town, who = rng.choice(_ROLES), place(rng), person(rng)
    pet, name = rng.choice(_PETS), _word(rng, 2)
    first = f"The {role} of {town} is {who}."
    second = f"{who} keeps a {pet} called {name}."
    at = depths(rng, 2)
    rng.shuffle(at)
    built = haystack(data, rng, tokens, [first, second], at, "essay")
    q = Question("bridge", f"What is the name of the {pet} kept by the {role} of {town}?", name,
                 (Hop(first, first), Hop(second)))
    return Case("bridge", (q,), context=built.context)


_EVENTS = ("harvest supper", "lantern walk", "river clean-up", "quiz night", "charity swim")


def survey(data: TaskData, rng: random.Random, tokens: int) -> Case:
    event, other = rng.sample(_EVENTS, 2)
    n = rng.randint(2, 5)
    names = [person(rng) for _ in range(n + rng.randint(1, 3))]
    facts = [f"{w} signed up for the {event if i < n else other}." for i, w in
             enumerate(names)]
    at = depths(rng, len(facts))
    rng.shuffle(at)
    built = haystack(data, rng, tokens, facts, at, "essay")
    order = sorted(range(n), key=lambda i: built.context.index(facts[i]))
    notes = ", ".join(names[i] for i in order)
    q = Question("survey", f"How many people signed up for the {event}?", str(n), (),
                 notes=notes)
    return Case("survey", (q,), context=built.context)


_TOPICS = ("tides", "allotments", "trams", "museum", "bell ringers", "ferry", "dairy", "canal")
TOOL = "read_file"
SYSTEM = ("You are an assistant in the user's project folder. Use the read_file tool to read "
          "files and answer questions from them.")


def agentic_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": TOOL, "description": "Read a text file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}}]


def agentic(data: TaskData, rng: random.Random, tokens: int) -> Case:
    n_files = rng.randint(2, 4)
    per = max(200, tokens // n_files)
    topics = rng.sample(_TOPICS, n_files)
    facts = _facts(rng, n_files + rng.randint(0, 2))
    where = [i % n_files for i in range(len(facts))]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Please read " + ", ".join(f"notes/{t}.md" for t in topics)
         + " and then answer my questions."},
    ]
    for i, t in enumerate(topics):
        mine = [f[0] for f, w in zip(facts, where, strict=True) if w == i]
        text = haystack(data, rng, per, mine, depths(rng, len(mine)), "essay").context
        call = {"name": TOOL, "arguments": json.dumps({"path": f"notes/{t}.md"})}
        messages.append({"role": "assistant", "content": "",
                         "tool_calls": [{"id": f"call_{i + 1}", "type": "function",
                                         "function": call}]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i + 1}", "name": TOOL,
                         "content": text})
    messages.append({"role": "assistant", "content": f"I have read the {n_files} files."})
    qs = [Question("agentic", q, a, (Hop(f),)) for f, q, a in facts]
    rng.shuffle(qs)
    return Case("agentic", tuple(qs[: rng.randint(1, 3)]), messages=tuple(messages))


GENERATORS: dict[str, Callable[[TaskData, random.Random, int], Case]] = {
    "planted": planted, "needle": needle, "squad": squad, "hotpot": hotpot,
    "compare": compare, "bridge": bridge, "agentic": agentic, "survey": survey,
}
