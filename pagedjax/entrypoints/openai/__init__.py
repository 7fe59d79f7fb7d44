"""The OpenAI-compatible server: request bodies (protocol), the engine thread (engine_loop),
the app and its routes (serving), logprob fields (logprobs)."""
