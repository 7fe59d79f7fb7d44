"""Scheduling and KV-block bookkeeping on the host: pure Python, no jax (tested as such)."""
