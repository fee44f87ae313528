"""Layout regions: what a model that mixes neighbouring tokens may not mix across."""

from __future__ import annotations

from declattn.protocol.layout import QUESTION, RESPONSE, SCAFFOLD, Layout, Span


def test_regions_name_chunks_question_response_and_scaffold() -> None:
    lay = Layout(
        prompt_len=12, sink=Span(0, 1), chunks=(Span(2, 4), Span(5, 7)), question=Span(9, 12)
    )
    want = [SCAFFOLD, SCAFFOLD, 1, 1, SCAFFOLD, 2, 2, SCAFFOLD, SCAFFOLD, QUESTION, QUESTION,
            QUESTION, RESPONSE, RESPONSE]
    assert lay.regions(0, 14) == want
    for a in range(14):  # any window agrees with the whole
        for b in range(a, 15):
            assert lay.regions(a, b) == want[a:b]
