"""Engine hosting: the engine serving a front end (vLLM's AsyncLLM and EngineCore), on a thread of
the server's process (``engine_loop``) or in a process of its own (``engine_process``, and its
client ``engine_client``, whose outputs cross as deltas: ``output_delta``); a server's start
(``startup``: what compiles before it answers) and the one function that launches a serving
engine (``launch``). The front ends code against engine/client.py's ``EngineClient``."""
