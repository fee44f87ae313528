"""A served model's own DA settings (``declattn.json``) are the defaults of its requests."""

from __future__ import annotations

from declattn.da.options import DAOptions
from declattn.protocol.instruction import BRIEF_INSTRUCTION
from declattn.server.prepare import da_options
from declattn.server.schemas import DARequest

OWN = DAOptions(target=16, cap=16, sink=4, style="inline", instruction=BRIEF_INSTRUCTION)


def test_a_request_starts_from_the_models_settings() -> None:
    o = da_options(DARequest(context="x"), OWN)
    assert (o.target, o.cap, o.sink, o.style, o.instruction) == (16, 16, 4, "inline",
                                                                 BRIEF_INSTRUCTION)


def test_the_request_overrides_what_it_sets() -> None:
    o = da_options(DARequest(context="x", chunk_tokens=64, masking=False, constrain=True), OWN)
    assert (o.target, o.cap, o.masking, o.constrain, o.sink) == (64, 64, False, True, 4)


def test_a_chunk_size_alone_keeps_the_models_cap_ratio() -> None:
    # the model's own chunks are never longer than their target: neither are a request's
    assert da_options(DARequest(context="x", chunk_tokens=40), OWN).cap == 40
    # the protocol's default ratio is 1.25
    assert da_options(DARequest(context="x", chunk_tokens=40)).cap == 50


def test_without_settings_the_defaults_are_the_protocols() -> None:
    assert da_options(DARequest(context="x")) == DAOptions()
