"""Training models to declare: DA masks from the decoder's own scope rules, generated
lookup tasks, a word-level tokenizer, a trainer for the engine's decoder, and ``da-tiny``.
See docs/training.md."""
