"""Benchmarks: commands that measure a part of declattn and return the figures."""
