"""Metrics: ``names`` (vLLM's metric names, helps and buckets), ``reader`` (vLLM's metric types,
what ``LLM.get_metrics()`` returns), ``offline`` (what LLM counts of its own requests), and the
server's Prometheus series: ``server`` (``ServerMetrics``, the ``pagedjax_`` names, which the
engine loop records into) and ``vllm_series`` (the same under vLLM's ``vllm:`` names)."""
