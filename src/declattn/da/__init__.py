"""The DA core: one request's Declarative Attention state, written once, torch-free.

What a request declares (``protocol/``) becomes what each decode step reads here: the
scope rules (``scope``), the request's state machine (``state``: tag reader, phrase
finder, logits constraints, scope and view, forced text, runaway guard), and the
counting of attended tokens (``accounting``, ``replay``). The engine's DA controller
(``declattn.api.session``) and the vLLM plugin's request tracker (``declattn.vllm``) both
drive the same ``DAState``; neither rebuilds it.
"""
