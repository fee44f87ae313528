"""A small paged inference engine whose decode attention reads only the kept KV blocks."""
