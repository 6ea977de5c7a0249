"""Model loading: the embedded default, GGUF files, Hugging Face directories, `tiny`, `random`.

Every checkpoint goes through one declarative table (`TABLE`): for each parameter of
`starpo.model.Transformer`, the tensor's name in Hugging Face checkpoints and in GGUF files, its
shape in those files (in symbols of the config), and whether it is an `nn.Linear` weight stored
[out, in] (ours are [in..., out...]). Every tensor's shape is checked against the table before
it is used, and a mismatch names the tensor and the file. The same table runs backwards for
export.

GGUF files written by llama.cpp for the `llama` architecture store the rows of Q and K
interleaved for its rotary layout; `_unpermute_rows` restores the checkpoint's half-split order.
What differs between the families (their files' names, their switches) is one row each in
`starpo/families.py`; a config.json field this code does not honour is an error, not a model
that silently computes something else.

Rooms: `tensors` (the table), `hf_dirs`, `gguf_files`, `embedded`, `tiny` (tiny and random
models), `load` (the entry point). This file re-exports their names: `weights.X` for any of them.
"""

from __future__ import annotations

from starpo.weights.tensors import (  # noqa: F401
    LoadError, Entry, TABLE, table, file_shape, to_ours, from_ours, params_from_tensors,
    tensors_from_params)
from starpo.weights.hf_dirs import (  # noqa: F401
    HF_ACTIVATIONS, config_from_hf, load_hf_dir, hf_config, save_hf_dir)
from starpo.weights.gguf_files import (  # noqa: F401
    _unpermute_rows, permute_rows, gguf_metadata, GGUF_GEMMA3_PATTERN, GGUF_GEMMA3_LOCAL_THETA,
    GGUF_GEMMA3_27B_LAYERS, config_from_gguf, load_gguf)
from starpo.weights.embedded import (  # noqa: F401
    Embedded, EMBEDDED, cache_dir, fetch_embedded, converted_dir)
from starpo.weights.tiny import (  # noqa: F401
    TINY_DEFAULTS, tiny_config, RANDOM_DEFAULTS, _parse_tiny, random_config)
from starpo.weights.load import (  # noqa: F401
    LoadedModel, MODEL_NAMES, load_model, model_kind)
from starpo.tokenizer import Tokenizer  # noqa: F401 (weights.Tokenizer, as before)
