"""The OpenAI-compatible server over an EngineClient (engine/client.py): request bodies
(protocol), the app and its routes (serving, routes), its options (app_options), one serving
object per endpoint (serving_completion, serving_chat, serving_tokenization over
serving_engine), each request run as one GenerationJob (job) answered by its response shape
(response_shapes). The engine it serves is hosted by pagedjax/engine/hosting/."""
