"""Automatic prefix caching (the BlockManager's matching and hashing half). Pure Python; imports
no jax.

A full block whose KV is computed is hashed over its parent's hash, its tokens and an extra key,
and stays cached (evictable) after its last holder frees it; a new prompt's leading full blocks
are matched against those. With a sliding window, a block is hashed only under a live, hashed
parent (entries released before the window end the chain), and a prompt holds only the hits its
first step reads. With LongRoPE, the extra key tells short-factor KV from long-factor KV; with
LoRA, it tells one adapter's KV from another's and from the base model's.
"""

from __future__ import annotations

from pagedjax.core.block_pool import Block
from pagedjax.core.block_swap import NULL_BLOCK
from pagedjax.core.sequence import Sequence


class PrefixCacheMixin:
    """Needs the BlockManager's tables, hash_fn, rope_switch_len and the pool."""

    def _match_prefix(self, seq: Sequence) -> list[Block]:
        """Cached blocks holding seq's leading full blocks; never its last token, which must be
        computed to yield logits."""
        hits: list[Block] = []
        if not self.enable_prefix_caching:
            return hits
        tokens = seq.get_token_ids()
        bs = self.block_size
        extra = self._cache_key(seq, seq.get_len())
        parent: Block | None = None
        for i in range((seq.get_len() - 1) // bs):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            parent_hash = parent.hash if parent else None
            block_id = self.hash_to_block_id.get(self.hash_fn(parent_hash, block_tokens, extra))
            if block_id is None:
                break
            block = self.blocks[block_id]
            # Hashes collide: a hit must have the same parent block, tokens and extra key.
            parent_identity = parent.identity() if parent else None
            if block.key != (parent_identity, block_tokens, extra):
                break
            hits.append(block)
            parent = block
        return hits

    def _cache_key(self, seq: Sequence, context_len: int):
        """The extra key of seq's cached blocks: its extra_hash_key, the LoRA adapter its KV is
        computed under (if any; another adapter's KV, or the base model's, differs), and with
        LongRoPE whether their KV was (or will be) computed with the long factors (context past
        rope_switch_len)."""
        key = seq.extra_hash_key
        if seq.lora_int_id:
            key = ("lora", seq.lora_int_id, key)
        if self.rope_switch_len is None:
            return key
        return key, context_len > self.rope_switch_len

    def mark_blocks_computed(self, seq: Sequence) -> None:
        """Offer seq's full blocks whose KV is written (by seq.num_computed_tokens) to the prefix
        cache. Call after each executed step; a block is a prefix hit only once marked."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        start = self._num_hashed_blocks[seq.seq_id]
        filled = seq.num_computed_tokens // bs
        if filled <= start:  # no block filled since the last call (most decode steps)
            return
        table = self._device_table(seq)
        num_full = min(filled, self._num_table_tokens(table) // bs)
        if num_full <= start:
            return
        tokens = seq.get_token_ids()
        extra = self._cache_key(seq, seq.num_computed_tokens)
        for i in range(start, num_full):
            # A block is cached only under a live, hashed parent: after a window freed the
            # entries before it (and a swap-in dropped their hashes) the chain cannot continue.
            if table[i] == NULL_BLOCK or (i and table[i - 1] == NULL_BLOCK):
                break
            block = self.blocks[table[i]]
            if block.hash is not None:  # hashed already through another holder
                continue
            parent = self.blocks[table[i - 1]] if i else None
            if parent is not None and parent.hash is None:
                break
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            parent_hash = parent.hash if parent else None
            block.hash = self.hash_fn(parent_hash, block_tokens, extra)
            block.key = (parent.identity() if parent else None, block_tokens, extra)
            self.hash_to_block_id.setdefault(block.hash, block.block_id)
        self._num_hashed_blocks[seq.seq_id] = max(start, num_full)
