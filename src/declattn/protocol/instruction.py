"""The text that teaches a model the Declarative Attention protocol.

It belongs in the final user turn, so it falls inside the question window: every mode can
read it. The wording names the same tags that ``tags.py`` reads and the same attention
rules that ``scope.py`` applies; change all three together.

Why a demonstration, and why it comes first: small models (Qwen2.5-Coder-0.5B was the
one measured) ignore rules stated in prose and copy the last example they read. A worked
example placed last was copied verbatim, answer included; bracketed placeholders were
echoed as text. So the instruction opens with a complete miniature case, visibly about
another document (its chunks, its question, then the reply), states the rules after it,
and leaves the real question for last: ``final_turn`` puts the question after the
instruction, the way the demonstration puts its question before its reply. Read after the
question instead, the same text made that model stop at once or answer without tags.

Two instructions: ``DA_INSTRUCTION`` (the default) teaches chunk numbers, with a global
survey before the focus; ``FIND_INSTRUCTION`` teaches ``<focus find="WORDS">`` and has no
global block at all. Small models copy words from the question well but do not navigate by
number (issue 16): with the find form the engine does the looking up, and no global survey
is read. Its demonstration is the same miniature case, so the two arms differ only in the
focus form.
"""

from __future__ import annotations

from collections.abc import Sequence

_DEMO_CASE = """\
Example (a made-up document, unrelated to yours):
Magic Chunk 1: "The bakery on Mill Lane sells rye bread."
Magic Chunk 2: "Our choir meets on Tuesdays."
Magic Chunk 3: "The last train to Leeds leaves at 11:40 pm."
Magic Chunk 4: "Parking is free after six."
Question: When does the last train to Leeds leave?
Reply:"""
_DEMO_END = """\
<local>The copied words give the time.</local>
<answer>11:40 pm</answer>"""

_DEMONSTRATION = f"""\
{_DEMO_CASE}
<global>Chunk 3 says the last train to Leeds leaves at 11:40 pm.</global>
<focus magic_chunks="3">the last train to Leeds leaves at 11:40 pm</focus>
{_DEMO_END}"""

_FIND_DEMONSTRATION = f"""\
{_DEMO_CASE}
<focus find="last train to Leeds">the last train to Leeds leaves at 11:40 pm</focus>
{_DEMO_END}"""

_TITLE = "How to answer: Declarative Attention."
_LAST_LINE = "Now reply the same way, using your own document."
_LOCAL_RULE = """\
- <local> ... </local> sees only the question and your reply so far, no chunk at all. \
Reason here from what you copied; do not recall anything else from the chunks."""
_END_RULE = """\
End with the final answer as <answer>...</answer>; your \
reply ends right after </answer>."""

_RULES = f"""\
Reply in tagged blocks, each tag on a line of its own. A tag says what its block can see:
- <global> ... </global> sees everything: every magic chunk, the question and your reply \
so far. Use it to say which chunk holds what the question needs.
- <focus magic_chunks="N"> ... </focus> sees only the chunks named in N (one to three \
chunk numbers separated by commas, such as "2" or "2,5"), plus the question and your \
reply so far. Inside it, copy the fact you found there, short: 1 to 12 words.
{_LOCAL_RULE}
Write at least one focus block. {_END_RULE}"""

DA_INSTRUCTION = f"""\
{_TITLE}
{_DEMONSTRATION}

The rules:
{_RULES}

{_LAST_LINE}"""

_FIND_RULES = f"""\
Reply in tagged blocks, each tag on a line of its own. A tag says what its block can see:
- <focus find="WORDS"> ... </focus> sees only the chunks that contain WORDS, plus the \
question and your reply so far. For WORDS, copy 2 to 6 words from the question that the \
chunk you need must contain, such as a name with its noun. Inside the block, copy the fact \
you found there, short: 1 to 12 words.
{_LOCAL_RULE}
Start with a focus block. {_END_RULE}"""

_ECONOMY_DEMONSTRATION = f"""\
{_DEMO_CASE}
<focus find="last train to Leeds"><answer>11:40 pm</answer>"""

_ECONOMY_RULES = """\
- Start with <focus find="WORDS">. For WORDS, copy 2 to 6 words from the question that \
the chunk you need must contain, such as a name with its noun. After the tag you see only \
that chunk, the question and your reply so far.
- Then write the short answer, taken from that chunk, as <answer>...</answer>; your reply \
ends right after </answer>.
- Only if the question needs facts from several places or the whole document at once \
(comparing, counting), write <global>short notes</global> before <answer>."""

ECONOMY_INSTRUCTION = f"""\
{_TITLE}
{_ECONOMY_DEMONSTRATION}

The rules:
{_ECONOMY_RULES}

{_LAST_LINE}"""
"""The shortest reply the protocol allows: a find focus, then the answer written inside
it from the focused chunk (``tags.py``: an answer opened in a focus reads that focus).
No global survey, no copy step, no local block: every token beyond the vanilla answer's
own is a tag, and tag text is read as local (``da.state``, scaffold steps)."""

PLAIN_INSTRUCTION = "Answer the question from the document, briefly."
"""The vanilla arm's final turn over the DA transcript (``render_prompt`` with this
instruction): the same chunks as the DA prompt, so the document's prefix is shared and
prefilled once; the turn asks for a plain answer and teaches no tags."""

INDEX_HEADER = "What each magic chunk names:"
"""Heads the optional in-context index (``protocol/index.py``) inside the instruction."""


def find_instruction(index: Sequence[str] = ()) -> str:
    """The find instruction; with ``index`` lines (one per chunk), they sit after the
    rules and before the closing line, so they too are in the question window."""
    block = f"{INDEX_HEADER}\n" + "\n".join(index) + "\n\n" if index else ""
    return f"""\
{_TITLE}
{_FIND_DEMONSTRATION}

The rules:
{_FIND_RULES}

{block}{_LAST_LINE}"""


FIND_INSTRUCTION = find_instruction()
"""``DA_INSTRUCTION``'s counterpart for ``<focus find="WORDS">``, with no index."""

QUESTION_LABEL = "Question:"
"""Introduces the real question after the instruction, as in the demonstration."""


BRIEF_INSTRUCTION = "Reply with Declarative Attention."
"""For models trained to declare (``declattn.train``): they need no demonstration, and the
long one would cost a tiny model most of its context."""


def final_turn(question: str, instruction: str = DA_INSTRUCTION) -> str:
    """The content of the final user turn: the instruction, then the question, last.

    The question goes last so that it is what the model reads right before it writes,
    as the demonstration shows; both stay in the final user turn, inside the question
    window. ``question`` may be a placeholder the caller substitutes later: it appears
    exactly once, verbatim, at the very end.
    """
    return f"{instruction}\n{QUESTION_LABEL}\n\n{question}"
