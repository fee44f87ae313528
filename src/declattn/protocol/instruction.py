"""The text that teaches a model the Declarative Attention protocol.

It sits at the end of the final user turn, after the question, so it falls inside the
question window: every mode can read it, and the model sees the rules again right
before it starts to write. The wording names the same tags that ``tags.py`` reads and
the same attention rules that ``scope.py`` applies; change all three together.
"""

from __future__ import annotations

DA_INSTRUCTION = """\
How to answer: Declarative Attention.
Split your reply into blocks. Open each block with a tag on a line of its own that \
declares what the block may read:
- <global> ... </global> reads everything: every magic chunk, the question and your \
reply so far. Use it to survey the document and decide where the needed facts are.
- <focus magic_chunks="K"> ... </focus> reads only the magic chunks named in K, plus the \
question and your reply so far. K is one to three chunk ids separated by commas, for \
example <focus magic_chunks="3"> or <focus magic_chunks="3,7">. Inside a focus block, \
copy the fact you found there, short: 1 to 12 words.
- <local> ... </local> reads only the question and your reply so far, no chunk at all. \
Reason here from what your focus blocks copied; do not recall anything else from the \
chunks.
Write at least one focus block. Finish with the final answer as <answer>...</answer>; \
your reply ends right after </answer>.

Example:
<global>The founding year should be in the company history; chunk 4 covers it.</global>
<focus magic_chunks="4">the firm was founded in 1987</focus>
<local>The question asks how old the firm was in 2000: 2000 - 1987 = 13.</local>
<answer>13 years</answer>"""
