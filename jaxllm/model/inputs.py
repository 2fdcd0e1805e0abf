"""What one device step reads: token ids, positions and the paged-KV addressing.

The contract between the host (`jaxllm.sched.batch` builds these arrays in numpy) and the model.

Tokens of one step are laid out in *tiles* of `tile_size = T // G` consecutive tokens that all
belong to one sequence and sit at consecutive positions. A sequence's chunk of new tokens is padded
at the *front* up to a whole number of tiles, so that the real tokens of every tile come last and
the tile's last row is always a real token. Decode steps use tiles of one token (G == T).
This one layout serves every attention backend: the portable jnp path gathers each tile's context
through its block table, and FlashAttention-style kernels take `q` as `[G, tile_size, N, H]`,
`page_table=block_tables`, `cache_seqlens=context_lens` with a bottom-right causal mask.

Legend: T tokens in the step, G tiles, W block-table width (blocks), S sampled rows.
"""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class ModelInputs:
    """One step's model inputs (a pytree of int32 arrays; shapes are the bucket's).

    Attributes:
        token_ids: [T] token ids; padding rows hold 0.
        positions: [T] position of each token in its sequence; padding rows hold 0.
        slot_mapping: [T] flat KV slot (block_id * block_size + offset) where each token's K/V is
            written; -1 for padding rows, which write nowhere.
        block_tables: [G, W] the block ids of each tile's sequence, in order; unused entries 0.
        context_lens: [G] number of KV positions each tile attends to, which is the position of
            the tile's last token + 1 (the cached context plus the new tokens up to this tile);
            0 for tiles that are all padding.
        sample_indices: [S] rows of `token_ids` whose logits are returned; padding entries 0.
    """

    token_ids: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    sample_indices: jax.Array

    @property
    def tile_size(self) -> int:
        return self.token_ids.shape[0] // self.block_tables.shape[0]
