"""The prefix cache's disk tier: K/V of whole prefill chunks in files that outlive the
process. ``tier.py``: how the engine uses it; ``identity.py``: what keys it;
``chunkfile.py``: the file format; ``atomic.py``: whole-or-nothing writes; ``store.py``:
the directory, eviction and listings; ``writer.py``: the background writes;
``options.py``: how it is asked for."""
