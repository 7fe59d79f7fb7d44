"""Inspection: per-step history, read-only views, snapshot / restore / diff (state.py), plots,
and the step profile. Reads exported state only (``BlockManager.view()``,
``KVCache.export_blocks()``, ``LLMEngine.state()``); never imports the engine."""
