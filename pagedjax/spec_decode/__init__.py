"""Speculative decoding: proposers, verification on the device, and its host bookkeeping.

``config`` (SpeculativeConfig) and ``metrics`` (SpecDecodingStats) are pure Python and imported
here; ``speculator`` (the host side, with the n-gram proposer in ``ngram``) and ``rejection`` (the
device side) are imported where they are used.
"""

from pagedjax.spec_decode.config import SpeculativeConfig
from pagedjax.spec_decode.metrics import SpecDecodingStats

__all__ = ["SpecDecodingStats", "SpeculativeConfig"]
