"""The engine: ``LLMEngine`` (add_request / step / abort), the step loop that overlaps host and
device, the input and output processors, and the request table.

Arrows: entrypoints -> engine -> {core, worker}; nothing below imports this package."""
