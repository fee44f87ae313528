"""Tests for the instructions: the find one beside the unchanged default."""

from __future__ import annotations

import re

from declattn.protocol.find import PhraseFinder
from declattn.protocol.instruction import (
    DA_INSTRUCTION,
    FIND_INSTRUCTION,
    INDEX_HEADER,
    QUESTION_LABEL,
    final_turn,
    find_instruction,
)
from declattn.protocol.modes import Mode
from declattn.protocol.tags import TagReader

_DEMO_CHUNK = re.compile(r'^Magic Chunk (\d+): "(.*)"$', re.M)


def _demo(instruction: str) -> tuple[list[str], str]:
    """The demonstration's chunk texts and its reply."""
    chunks = [m[2] for m in _DEMO_CHUNK.finditer(instruction)]
    reply = instruction.split("Reply:\n", 1)[1].split("\n\n", 1)[0]
    return chunks, reply


def test_the_default_instruction_is_unchanged() -> None:
    assert DA_INSTRUCTION.startswith("How to answer: Declarative Attention.\nExample")
    assert '<global>Chunk 3 says' in DA_INSTRUCTION
    assert '<focus magic_chunks="3">' in DA_INSTRUCTION and "find=" not in DA_INSTRUCTION
    assert final_turn("Q?") == f"{DA_INSTRUCTION}\n{QUESTION_LABEL}\n\nQ?"


def test_find_instruction_opens_with_its_demonstration_and_has_no_global() -> None:
    assert FIND_INSTRUCTION.startswith("How to answer: Declarative Attention.\nExample")
    assert FIND_INSTRUCTION.index("Reply:") < FIND_INSTRUCTION.index("The rules:")
    assert "<global>" not in FIND_INSTRUCTION and "magic_chunks" not in FIND_INSTRUCTION
    assert FIND_INSTRUCTION.endswith("Now reply the same way, using your own document.")
    assert final_turn("Q?", FIND_INSTRUCTION).endswith(f"{QUESTION_LABEL}\n\nQ?")


def test_the_find_demonstration_is_a_valid_reply_to_its_own_document() -> None:
    """Read by the real reader against the demonstration's chunks, the reply focuses the
    chunk that holds the fact, and the copied text is in that chunk."""
    chunks, reply = _demo(FIND_INSTRUCTION)
    assert len(chunks) == 4
    reader = TagReader(len(chunks), finder=PhraseFinder(chunks))
    decls = reader.feed(reply)
    reader.finish()
    assert [d.kind for d in decls] == ["focus", "/focus", "local", "/local", "answer", "/answer"]
    focus = decls[0]
    assert focus.accepted and focus.focus_ids == (3,) and focus.match == "exact"
    assert focus.mode is Mode.FOCUS
    copied = reply[focus.end : decls[1].start]
    assert copied.lower() in chunks[2].lower()
    assert all(d.accepted for d in decls)


def test_both_instructions_share_the_case_and_the_closing_blocks() -> None:
    da_chunks, da_reply = _demo(DA_INSTRUCTION)
    find_chunks, find_reply = _demo(FIND_INSTRUCTION)
    assert da_chunks == find_chunks
    assert da_reply.splitlines()[-2:] == find_reply.splitlines()[-2:]  # local, answer


def test_the_index_goes_after_the_rules_before_the_closing_line() -> None:
    lines = ["Chunk 1: Mill Lane", "Chunk 2: Tuesdays"]
    text = find_instruction(lines)
    assert find_instruction() == FIND_INSTRUCTION and INDEX_HEADER not in FIND_INSTRUCTION
    block = f"{INDEX_HEADER}\nChunk 1: Mill Lane\nChunk 2: Tuesdays\n\n"
    last = "Now reply the same way"
    assert text == FIND_INSTRUCTION.replace(last, block + last)
    assert text.index("The rules:") < text.index(INDEX_HEADER)
