"""Deviceless compiles: the engine's programs and kernels compiled for a TPU or GPU that is not
here, by that machine's own compiler (``pagedjax compile``; cli.py)."""
