"""The device side: the KV pool, the jitted step that reads and writes it, sampling."""
