"""An in-context index: one line per magic chunk with the names that set it apart.

With ``<focus find="WORDS">`` a model has to know words the chunk it needs contains. The
question usually supplies them; where it does not (a paraphrase, a second hop), an index
can: ``Chunk 3: Leeds, Mill Lane, 11:40``. It goes in the always-read part of the prompt
(``instruction.find_instruction(index=...)`` puts it in the final user turn, inside the
question window), so it costs every question its tokens: ``budget`` bounds them, and the
study decides whether it earns them (issue 16: it did not help numeric focus).

A name is a run of capitalised words (``Mill Lane``, ``Brack Island``) or a number
(``1871``, ``11:40``). A capitalised word that the context never writes capitalised
mid-sentence is a sentence start, not a name, when it stands alone (``Parking``) or the
context also writes it in lower case (``The`` in ``The Mill Lane``); ``Maria`` in a
sentence-initial ``Maria Olsen`` stays. A chunk's names are
ranked by how few chunks they occur in, then by how often they occur in it, then by first
appearance, so the line names what is particular to that chunk. A chunk that opens with a heading
(``# Title`` or a short first line without final punctuation) leads its line with it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from declattn.protocol.find import normalize

_NAME_RE = re.compile(
    r"(?<![\w'’])(?:[A-Z][\w'’-]*(?:[ \t]+(?:of|the|de|van|von|du|da)?[ \t]*[A-Z][\w'’-]*)*)"
    r"|(?<![\w.:/-])\d+(?:[.:/,-]\d+)*"
)
_CAP_RE = re.compile(r"(?<![\w'’])[A-Z][\w'’-]*")
_LOWER_RE = re.compile(r"(?<![\w'’])[a-z][\w'’-]*")
_SENTENCE_END_RE = re.compile(r"(?:^|[.!?:;\n#][\"'’”)\]]*)\s*$")
_TITLE_MAX_CHARS = 60
_TITLE_MAX_WORDS = 8


def _title(text: str) -> str | None:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if line.startswith("#"):
        return line.lstrip("#").strip() or None
    short = len(line) <= _TITLE_MAX_CHARS and len(line.split()) <= _TITLE_MAX_WORDS
    return line if short and line[-1] not in ".!?,;:" and line != text.strip() else None


def _opens_sentence(text: str, at: int) -> bool:
    return _SENTENCE_END_RE.search(text, max(0, at - 8), at) is not None


def _mid_sentence_caps(texts: Sequence[str]) -> set[str]:
    """Capitalised words written somewhere other than at a sentence start."""
    return {m[0] for t in texts for m in _CAP_RE.finditer(t) if not _opens_sentence(t, m.start())}


def _names(text: str, caps: set[str], lower: set[str]) -> list[str]:
    """Candidate names in order of first appearance, one per normalised form."""
    out: dict[str, str] = {}
    for m in _NAME_RE.finditer(text):
        words = m[0].split()
        while words and not words[0][0].isdigit() and words[0] not in caps:
            if len(words) > 1 and words[0].lower() not in lower:
                break  # "Maria Olsen" opening a sentence
            words = words[1:]  # a sentence start: "The Mill Lane" -> "Mill Lane"
        name = " ".join(words)
        key = normalize(name)
        if key and key not in out:
            out[key] = name
    return list(out.values())


def chunk_index(
    chunk_texts: Sequence[str], count_tokens: Callable[[str], int], budget: int
) -> list[str]:
    """One line per chunk, ``Chunk N: name, name, ...``, in at most ``budget`` tokens
    (counted by ``count_tokens`` on the lines joined by newlines).

    Each line gets an equal share of the budget; a chunk with no name gets a bare
    ``Chunk N:`` line, so line N is always chunk N. Raises ``ValueError`` when the budget
    cannot hold even the bare lines.
    """
    n = len(chunk_texts)
    if n == 0:
        return []
    bare = [f"Chunk {i}:" for i in range(1, n + 1)]
    need = count_tokens("\n".join(bare))
    if need > budget:
        raise ValueError(f"an index of {n} chunks needs at least {need} tokens, budget {budget}")
    caps = _mid_sentence_caps(chunk_texts)
    lower = {w for t in chunk_texts for w in _LOWER_RE.findall(t)}
    per_chunk = [_names(t, caps, lower) for t in chunk_texts]
    df: dict[str, int] = {}
    for names in per_chunk:
        for key in {normalize(x) for x in names}:
            df[key] = df.get(key, 0) + 1
    share = budget // n
    lines = []
    for i, (text, names) in enumerate(zip(chunk_texts, per_chunk, strict=True), 1):
        folded = f" {normalize(text)} "
        keyed = [(normalize(x), x) for x in names if n == 1 or df[normalize(x)] < n]
        ranked = sorted(
            keyed, key=lambda kx: (df[kx[0]], -folded.count(f" {kx[0]} "), folded.find(kx[0]))
        )
        title = _title(text)
        chosen: list[str] = [title] if title else []
        line = bare[i - 1]
        for key, name in ranked:
            if any(_within(key, c) for c in chosen):
                continue  # "Leeds" once "Leeds Station" is named
            trial = [c for c in chosen if c == title or not _within(normalize(c), name)]
            trial.append(name)  # "Leeds Station" replaces "Leeds"
            if count_tokens(f"Chunk {i}: " + ", ".join(trial)) <= share:
                chosen = trial
        if chosen and count_tokens(f"Chunk {i}: " + ", ".join(chosen)) <= share:
            line = f"Chunk {i}: " + ", ".join(chosen)
        lines.append(line)
    while count_tokens("\n".join(lines)) > budget:  # token counts are not additive
        longest = max(range(n), key=lambda k: len(lines[k]))
        lines[longest] = _drop_last(lines[longest])
    return lines


def _within(key: str, name: str) -> bool:
    """Whether the normalised ``key`` is a run of whole words of ``name``."""
    return f" {key} " in f" {normalize(name)} "


def _drop_last(line: str) -> str:
    """The line without its last name (a bare ``Chunk N:`` once none is left)."""
    head, _, names = line.partition(": ")
    kept = names.split(", ")[:-1]
    return f"{head}: " + ", ".join(kept) if kept else head.rstrip(":") + ":"
