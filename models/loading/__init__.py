"""The parts of loading a model (models/loader.py runs them): hf, gguf, convert, cache,
tokenizer."""
