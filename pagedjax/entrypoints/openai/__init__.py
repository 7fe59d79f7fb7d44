"""The OpenAI-compatible server over an EngineClient (engine/client.py): request bodies
(protocol), the app and its routes (serving, routes), its options (app_options), logprob fields
(logprobs). The engine it serves is hosted by pagedjax/engine/hosting/."""
