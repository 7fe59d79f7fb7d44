"""Benchmarks: throughput, KV memory utilisation, sharing."""
