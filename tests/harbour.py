"""A small harbour log and a DA transcript over it, shared by the session tests and the
quantised-engine parity tests."""

CONTEXT = "\n\n".join(
    f"Paragraph {i}: the harbour log for day {i} notes calm water, {i * 3} boats and "
    f"a keeper named Ada who counted gulls from the gallery." * 3
    for i in range(1, 13)
)
QUESTION = "How many boats were in the harbour on day 5?"
TRANSCRIPT = (
    "<global>Day 5 should be in chunk 2.</global>\n"
    '<focus magic_chunks="2">day 5 notes 15 boats</focus>\n'
    "<local>So the answer is 15.</local>\n"
    "<answer>15</answer>"
)
