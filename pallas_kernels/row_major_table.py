"""An embedding table [N, K] kept as it is: the part of a table method that every row-major
layout shares (shape, check, no processing at load, ``jnp.take`` lookup). Subclasses choose the
tied head, ``attend(x, table)`` = ``x @ table.T``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RowMajorTable:
    def table_shape(self, n: int, k: int) -> tuple[int, ...]:
        return (n, k)

    def accepts(self, table: jax.Array) -> bool:
        return table.ndim == 2

    def process_weights_after_loading(self, table: jax.Array) -> jax.Array:
        return table

    def lookup(self, table: jax.Array, ids: jax.Array) -> jax.Array:
        return jnp.take(table, ids, axis=0)

    def attend(self, x: jax.Array, table: jax.Array) -> jax.Array:
        raise NotImplementedError
