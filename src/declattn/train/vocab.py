"""A word-level tokenizer for models trained from scratch on generated DA tasks.

Built with the ``tokenizers`` library and saved as ``tokenizer.json`` plus a
``tokenizer_config.json`` holding a ChatML chat template, so a trained model directory
loads through ``transformers.AutoTokenizer`` like any Hugging Face model, and our
prompt renderer, tag reader and focus constraint work on it unchanged.

Why word-level: a tiny model should spend its capacity on the lookup, not on spelling.
Each DA tag is one token (``<focus magic_chunks="`` and ``">`` bracket the chunk ids,
which stay ordinary number words), and a pre-token is a word with at most one leading
space, a run of punctuation, or a run of whitespace; decoding concatenates, so every
text built from the vocabulary round-trips exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

UNK = "<unk>"
PAD = "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIALS = (UNK, PAD, IM_START, IM_END)
TAG_TOKENS = (
    "<global>",
    "</global>",
    '<focus magic_chunks="',
    '">',
    "</focus>",
    "<local>",
    "</local>",
    "<answer>",
    "</answer>",
)
PRE_TOKEN = r" ?[A-Za-z0-9_]+| ?[^A-Za-z0-9_\s]+|\s+"

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Split(Regex(PRE_TOKEN), behavior="isolated")


def words_of(texts: Iterable[str]) -> set[str]:
    """The pre-tokens of ``texts`` (with tags and specials cut out), for the vocabulary."""
    pre = _pre_tokenizer()
    cut = Regex("|".join(_escape(t) for t in (*SPECIALS, *TAG_TOKENS)))
    splitter = pre_tokenizers.Split(cut, behavior="removed")
    out: set[str] = set()
    for text in texts:
        for piece, _ in splitter.pre_tokenize_str(text):
            out.update(w for w, _ in pre.pre_tokenize_str(piece))
    return out


def _escape(token: str) -> str:
    return "".join("\\" + c if not c.isalnum() else c for c in token)


def build_tokenizer(words: Iterable[str]) -> Tokenizer:
    """A word-level tokenizer over ``words`` plus the specials and the DA tags."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for w in sorted(set(words) - set(vocab)):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    tok.add_tokens(list(TAG_TOKENS))
    return tok


def save_tokenizer(tok: Tokenizer, directory: Path) -> None:
    """``tokenizer.json`` and a ``tokenizer_config.json`` with the chat template."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "unk_token": UNK,
        "pad_token": PAD,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
