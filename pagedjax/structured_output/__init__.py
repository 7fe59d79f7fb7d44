"""Structured output: constraints compiled with llguidance (grammar.py), the bounds checked before
compiling (limits.py), and the worker thread that compiles with its own stack (worker.py)."""
