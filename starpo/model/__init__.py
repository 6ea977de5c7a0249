"""The decoder of the Llama, Qwen2, Qwen3 and Gemma 3 families in Flax, with a functional KV
cache and an optional value head.

One module covers SmolLM2, Llama 3.x, Qwen2.5, Qwen3 and Gemma 3: RMSNorm, rotary embeddings
(theta from the checkpoint, Llama-3 or linear frequency scaling where configured),
grouped-query attention, a gated MLP, tied or untied output head, and the switches a family
sets (`starpo/families.py`): q/k/v bias (Qwen2); an RMSNorm over each head's query and key
before the rotary embedding (Qwen3, Gemma 3); and Gemma 3's own: norms that scale by (1 + w),
norms after attention and after the MLP too, a tanh-GELU gate, embeddings times sqrt(width),
a query scale of its own, and sliding-window layers (`local_layers`) that attend to the last
`sliding_window` positions only, with a rotary base of their own. A sliding window is the same
mask as a context window over turns (`window_mask`) with rotary positions in place of turns,
so every attention kernel and cache path applies it as it applies a `TurnWindow`.

One driver, `hidden_states`, runs every forward (training forward, cache append, decode step):
it computes the chunk's geometry (rotary positions, masks, cache write slots, context window)
once and runs `Block` over the layers, as a scan over the stacked weights `layers` [L,...] (a
30-layer model compiles like a 1-layer one) or as a loop over per-layer buffers cut once for
decoding (`split_layers`, `split_cache`), with the same numbers.

Einsum letters: B batch, T query tokens, S key slots, D model width, H query heads,
K kv heads, G query heads per kv head (H = K*G), E head dim, F MLP width, V vocab.

The cache is an explicit argument that goes in and comes back out (no mutable collections).
Each row writes its chunk of tokens at its own slot offset `end[b]`; rotary positions count only
real tokens, so left padding, right padding and per-row appends all give the same numbers as the
unpadded row alone.

A context window (`TurnWindow`, off unless given) restricts what each token attends to by the
turn of the dialogue it belongs to: the prompt prefix and the last `size` turns (the current one
included). It is an attention mask over the same slots and the same rotary positions, applied
alike by the training forward, the cache append and the decode step, so a token's log-prob in
training is the one it was sampled with.

Every weight names its logical axes (`embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`,
stacked under `layers`); `starpo/sharding.py` maps them onto a device mesh.

Rooms, from the bottom: `spec` (ModelConfig, rotary), `kvcache` (the cache, the context window),
`ops` (matmuls and attention kernels), `dense` (norms, projections), `masks` (a chunk's geometry),
`attend` (attention), `decoder` (MLP, Block, Transformer), `api` (params, forward, heads).
This file re-exports their names: `model.X` for any of them.
"""

from __future__ import annotations

from starpo.model.spec import (  # noqa: F401
    ACTIVATION_AXES, ACTIVATIONS, apply_rope, ModelConfig, REMAT_POLICIES, rope_inv_freq,
    _MASK_VALUE, ATTENTION, DECODE_ATTENTION)
from starpo.model.kvcache import (  # noqa: F401
    init_cache, KVCache, PREFIX_TURN, TurnWindow, window_mask)
from starpo.model.ops import (  # noqa: F401
    attention_block, causal_attention, check_kernels, cudnn_refusal, decode_kernel, gpu_capability,
    kernels, mixed_einsum, _attention_blocks)
from starpo.model.dense import (  # noqa: F401
    RMSNorm, _projection)
from starpo.model.masks import (  # noqa: F401
    row_positions)
from starpo.model.attend import (  # noqa: F401
    Attention, CACHE_QUERY_BLOCK, _attend_causal, _attend_written_cache)
from starpo.model.decoder import (  # noqa: F401
    Block, MLP, Transformer)
from starpo.model.api import (  # noqa: F401
    abstract_params, forward, head_logits, head_values, hidden_states, init_params, is_split,
    logical_axes, param_shardings, split_cache, split_layers, stack_cache)
