"""declattn."""
