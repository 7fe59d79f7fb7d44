"""The parts of loading a model (models/loader.py runs them): hf, gguf, convert, cache,
tokenizer, and what a load gives (loaded.py's LoadedModel)."""
