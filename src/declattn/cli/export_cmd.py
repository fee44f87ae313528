"""``declattn export``: a model trained here as one GGUF file, for other engines.

A model taught to declare with a LoRA adapter (``declattn train da-lora``, or the
shipped ``qwen2.5-0.5b-da``) is its base GGUF with the adapter merged into the base's
own blocks (``engine/merged.py``): llama.cpp, and anything else that reads GGUF, loads
it like the base; our engine also reads the DA settings it carries.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from declattn.cli.common import UserError, console, user_errors


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export", help="write a model trained to declare as a merged GGUF file",
        description="Merge a LoRA adapter into its base model's GGUF blocks and write the "
        "result, with the model's DA settings in its metadata.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a shipped adapter model (qwen2.5-0.5b-da)")
    src.add_argument("--adapter", help="an adapter directory from `declattn train da-lora`")
    p.add_argument("--base", help="the base model for --adapter (default: the one the "
                   "adapter was trained on)")
    p.add_argument("--gguf", required=True, help="the GGUF file to write")
    p.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from declattn.engine.adapter import ADAPTER_CONFIG, AdapterError, adapter_sha256
    from declattn.engine.merged import merge_adapter
    from declattn.engine.registry import ADAPTERS, resolve_model

    if args.model is not None:
        if args.model not in ADAPTERS:
            raise UserError(f"--model must be one of {', '.join(ADAPTERS)} (a model with an "
                            f"adapter), not {args.model!r}; for another, pass --adapter DIR")
        shipped = ADAPTERS[args.model]
        directory, base_name = shipped.directory, args.base or shipped.base
    else:
        directory = Path(args.adapter)
        if not (directory / ADAPTER_CONFIG).is_file():
            raise UserError(f"{directory}: no {ADAPTER_CONFIG} (not an adapter directory)")
        trained_on = json.loads((directory / ADAPTER_CONFIG).read_text()).get(
            "base_model_name_or_path")
        base_name = args.base or trained_on
        if not base_name:
            raise UserError(f"{directory}: the adapter names no base; pass --base")
    settings_file = directory / "declattn.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else None
    out = Path(args.gguf)
    con = console()
    with user_errors():
        base = resolve_model(base_name)
        if base.is_dir():
            raise UserError(f"{base}: the base must be a GGUF file to merge into")
        with con.status(f"merging {directory.name} into {base.name}"):
            try:
                report = merge_adapter(base, directory, out, settings, adapter_sha256(directory))
            except AdapterError as e:
                raise UserError(str(e)) from e
    t = report.totals()
    con.print(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB): {t['matrices']} matrices "
              f"merged, {t['codes_changed']:.2%} of their codes changed, the adapter's update "
              f"kept {t['kept']:.1%} (relative error {t['error']:.2f})")
    return 0
