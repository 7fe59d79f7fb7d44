"""Metrics under vLLM's names: ``reader`` holds vLLM's metric types (what ``LLM.get_metrics()``
returns), ``offline`` what LLM counts of its own requests."""
