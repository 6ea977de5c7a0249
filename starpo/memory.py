"""A memory plan: the peak device memory of each phase of a run, from its config and the model's
shape, checked against the device before the first step.

    phases = memory.plan(run_config.read(config), model_cfg, mesh_shape=(1, 8, 1))
    print(memory.describe(phases, capacity))
    memory.check(phases, capacity)        # MemoryPlanError naming the phase and the knobs

Each phase is the sum of named parts, per device (weights and optimizer states split over the
mesh's fsdp x tensor axes, batch rows over data x fsdp). The parts follow the programs'
structure (the buffers XLA's buffer assignment shows for them):
- state: actor weights, AdamW moments (2 per weight), the critic's copy with its moments, the
  frozen reference for a KL term; all float32 master copies. With LoRA (`model.lora`): one
  frozen base in the update's dtype, which the actor, the critic copy and the reference share,
  and float32 adapters with their moments per model.
- rollout / validation (B episodes at once, cache S slots): the KV cache, 2 x L x B x K x S x E
  in the decode dtype, in per-layer buffers updated in place (twice over with decode windows:
  the switch's whole-cache branch decodes on a copy); the weights cast for decoding (one more
  copy of them); the prefill of a P-token prompt chunk: its scores, in blocks of
  Q = `model.CACHE_QUERY_BLOCK` queries, 2 x B x H x S x Q floats over the cache and
  3 x B x H x Q x P over the chunk itself, and its activations (per token two MLP-wide matmul
  outputs, four float32 copies of the residual stream and every layer's new keys and values);
  per-slot rows (tokens, log-probs, masks) and the Trajectory.
- update (micro-batches of M rows over T tokens): gradient accumulators as large as the
  weights; per layer the saved activations of the remat policy ("full": a layer's input;
  "save_dense": also its dense outputs; off: all of it); the one layer being recomputed,
  including attention's probabilities (M x H x T x T floats on the CPU path, none with
  cuDNN's or splash's flash attention); the log-prob head's logits, 3 x M x C x V floats for chunks of C
  tokens (`algorithm.logit_chunk_size`).
`tests/test_memory.py` compares the totals with XLA's own compiled memory analysis on CPU.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax.numpy as jnp

from starpo import dialogue, lora, run_config
from starpo import update as update_lib
from starpo.model import CACHE_QUERY_BLOCK, ModelConfig
from starpo.precision import backend as target_backend

GB = 1e9


class MemoryPlanError(ValueError):
    """The run cannot fit; the message is one line naming the phase and the knobs to change."""


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    parts: tuple  # ((what, bytes), ...)
    knobs: tuple  # config keys that shrink this phase

    @property
    def total(self) -> float:
        return float(sum(b for _, b in self.parts))


def _bytes(dtype: str) -> int:
    return jnp.dtype(dtype).itemsize


def state_parts(algo, cfg: ModelConfig, model_shards: int, base_dtype: str = "float32") -> tuple:
    """(what, bytes) of the TrainState and the reference weights, per device (`algo`: the
    run's `run_config.AlgoConfig`; `base_dtype`: a LoRA base's)."""
    if cfg.lora_rank:  # one shared frozen base; per model, float32 adapters (+ 2 moments)
        a = lora.num_adapter_params(cfg) * 4 / model_shards
        parts = [("frozen base weights (shared)", cfg.num_params * _bytes(base_dtype)
                  / model_shards), ("actor adapters + AdamW moments", 3 * a)]
        if algo.uses_critic:
            parts += [("critic adapters + moments", 3 * a)]
        if algo.uses_reference:
            parts += [("reference adapters", a)]
        return tuple(parts)
    p = cfg.num_params * 4 / model_shards
    parts = [("actor weights", p), ("actor AdamW moments", 2 * p)]
    if algo.uses_critic:
        parts += [("critic weights + moments", 3 * p)]
    if algo.uses_reference:
        parts += [("reference weights", p)]
    return tuple(parts)


# what `trainer.offload_state` keeps in host memory while the actor samples (update.offload)
OFFLOADED = ("actor AdamW moments", "critic weights + moments")


def prefill_parts(cfg: ModelConfig, rows: float, slots: int, prompt_tokens: int, *,
                  dtype: str, split: bool = False) -> tuple:
    """(what, bytes) of appending a chunk of `prompt_tokens` tokens to a cache of `slots` slots
    in `rows` rows, beyond the cache and the weights: its attention scores (blocks of
    `CACHE_QUERY_BLOCK` queries) and its activations (the matmul outputs in `dtype`, the
    residual stream in float32, every layer's new keys and values). split: the cache in
    per-layer buffers (`model.split_cache`, as the rollout keeps it): each layer writes its
    new keys and values in place and a block of queries attends over the cache alone."""
    L, D, H, K, E, F = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                        cfg.head_dim, cfg.intermediate_size)
    P = min(prompt_tokens, slots)
    Q = min(CACHE_QUERY_BLOCK, P)
    scores = 2 * rows * H * slots * Q + (0 if split else 3 * rows * H * Q * P)
    new_kv = 0 if split else 2 * L * K * E
    return (
        ("prompt prefill scores", scores * 4),
        ("prompt prefill activations", rows * P * ((2 * F + new_kv) * _bytes(dtype)
                                                   + 4 * D * 4)),
    )


def cache_copies(windows: int, version: str | None = None) -> float:
    """How many times over the rollout holds its KV cache (XLA:CPU's compiled buffers of a
    rollout whose cache is most of its memory, `tests/test_memory.py`). The rollout keeps
    per-layer buffers for good and decodes on them in place: once, twice with decode windows
    (the window switch's whole-cache branch works on a copy), with jax 0.10.2; jax 0.7.1's XLA
    copies them around the loops, 2.0 and 3.3 times. `version`: jax's (default: installed)."""
    import jax

    major, minor = (int(x) for x in (version or jax.__version__).split(".")[:2])
    if (major, minor) >= (0, 10):
        return 2.0 if windows > 1 else 1.0
    return 3.3 if windows > 1 else 2.0


def kv_tile_padding(kv_heads: int, head_dim: int, platform: str | None = None) -> float:
    """How many times over a `platform` ("cpu", "gpu", "tpu"; default: the target backend)
    stores the KV cache's values. 1 but on a TPU, where XLA lays each cache buffer out with
    (kv heads, head dim) as its tiled minor dims: the head dim is rounded up to the 128 lanes,
    the kv heads to a power of two up to 8 and to a multiple of 8 beyond (the compiled buffers
    of libtpu 0.0.42 for v5e: `tests/test_aot.py`). SmolLM2 (3 kv heads of 64) is held 2.7x,
    Qwen2.5-0.5B (2 of 64) 2x, heads of 128 in powers of two 1x."""
    if (platform or target_backend()) != "tpu":
        return 1.0
    K = kv_heads
    rows = 1 << (K - 1).bit_length() if K <= 8 else -(-K // 8) * 8
    return rows / K * (-(-head_dim // 128) * 128) / head_dim


def episode_parts(cfg: ModelConfig, rows: float, slots: int, *, decode_dtype: str,
                  windows: int, prompt_tokens: int, model_shards: int, share: int = 1) -> tuple:
    """(what, bytes) of playing `rows` episodes (per device) with a cache of `slots` slots.
    share: rows per group whose first prompt is appended once (`Rollout.share`): the prefill
    runs on rows / share rows, whose cache is then copied to every row. On a TPU the cache
    counts its tiles' padding (`kv_tile_padding`)."""
    L, K, E = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    padding = kv_tile_padding(K, E)
    kv = 2 * L * rows * K * slots * E * _bytes(decode_dtype) * padding
    # a shared first prompt's cache is gathered into new buffers that the one turn owns:
    # jax 0.7.1's XLA then holds it once too (tests/test_memory.py, one decode window)
    copies = cache_copies(windows, "0.10" if share > 1 else None)
    shared = (("KV cache of one row per group (a shared first prompt)", kv / share),) if (
        share > 1) else ()
    return (
        ("KV cache (held ~%.1fx in the loop%s)" % (
            copies, f", TPU tiles {padding:.1f}x" if padding > 1 else ""), copies * kv),
        *shared,
        ("weights cast for decoding", cfg.num_params * _bytes(decode_dtype) / model_shards),
        *prefill_parts(cfg, rows / share, slots, prompt_tokens, dtype=decode_dtype, split=True),
        ("slot rows and trajectory", rows * slots * 30),
    )


def update_parts(model: run_config.ModelSpec, algo, cfg: ModelConfig, rows: float,
                 micro: float, context: int, *, update_dtype: str, model_shards: int,
                 attention: str = "cpu", packed: tuple[float, int] | None = None) -> tuple:
    """(what, bytes) of the update's working memory beyond the state, per device: `rows` kept
    rows of `context` tokens in micro-batches of `micro` rows; `attention`: the kernels of
    attention over a sequence (`model.kernels`: "cpu", "xla", "cudnn" or "splash"); `packed`: (groups,
    tokens) of the actor's micro-batch where the PPO loss packs a group's prompt once
    (`update.static_loss_share`: groups of `packed` sequences, their rows' replies in them;
    the critic's keeps `micro` rows)."""
    L, D, H, K, E, F, V = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.intermediate_size, cfg.vocab_size)
    w = _bytes(update_dtype)
    dense = (H * E + 2 * K * E + 2 * D + 3 * F) * w  # per token: q k v o gate up down outputs
    # LoRA, per token and adapted projection: x A (rank r) and its B output, both matmul
    # outputs (kept by "save_dense"); XLA fuses the sum with the base output into the B matmul
    outs = {"q": H * E, "k": K * E, "v": K * E, "o": D, "gate": F, "up": F, "down": D}
    adapted = [t for t in cfg.lora_targets if t in outs] if cfg.lora_rank else []
    dense += sum(cfg.lora_rank + outs[t] for t in adapted) * w

    def model_pass(M, T):  # (saved activations, one recomputed layer) of M sequences of T
        layer = (4 * D * 4 + dense + 2 * F * w) * M * T  # one layer's live activations
        if attention in ("cudnn", "splash"):  # flash attention: one softmax statistic a row
            scores = M * H * T * 4
        else:  # the CPU path keeps each block's probabilities; XLA's recomputes [M,H,T,T]
            scores = M * H * T * T * 4
        if not model.remat:
            saved = L * (layer + scores)
        elif model.remat_policy == "save_dense":
            saved = L * M * T * (D * 4 + dense)
        else:
            saved = L * M * T * D * 4
        return saved, layer + scores

    T, M = context, micro
    saved, recomputed = model_pass(*(packed or (M, T)))
    head_rows = packed[0] * algo.group_size if packed else M
    if algo.uses_critic:  # the critic's pass, as large unless the actor's packs
        critic_saved, critic_layer = model_pass(M, T)
        saved, recomputed = saved + critic_saved, max(recomputed, critic_layer)
    chunk = min(algo.logit_chunk_size or T, T)
    critic = 2.0 if algo.uses_critic else 1.0
    trained = lora.num_adapter_params(cfg) if cfg.lora_rank else cfg.num_params
    grads = trained * 4 / model_shards * critic
    return (
        ("gradient accumulators", grads),
        ("saved activations", saved),
        ("recomputed layer + attention", recomputed),
        ("log-prob head logits", 3 * head_rows * chunk * V * 4),
        ("batch rows", rows * T * 40),
    )


HOPPER_WORKSPACE = 32 * 2 ** 20  # cuBLAS's recommended workspace from compute capability 9 on


def _nvidia_gpu(device=None):
    """`device` (default: the first JAX device) where it is an NVIDIA GPU, else None."""
    if device is None:
        import jax

        device = jax.devices()[0]
    if device.platform != "gpu" or "nvidia" not in str(device.device_kind).lower():
        return None
    return device


def matmul_workspace(device=None) -> float:
    """Bytes XLA:GPU reserves among a program's temporaries for cuBLAS's workspace: 32 MiB on
    Hopper and later (compute capability 9+), 4 MiB before (cuBLAS's recommended sizes, which
    XLA's gemm calls take); 0 on other backends. `device`: a JAX device (default: the first).
    Measured on an H100: tiny programs' compiled temporaries were 22-30 MB above the plan
    without it. The plan counts it in every program, an upper bound: XLA adds it only to
    programs where autotuning kept a cuBLAS call (`compiled_workspace`)."""
    device = _nvidia_gpu(device)
    if device is None:
        return 0.0
    major = str(getattr(device, "compute_capability", "9.0")).split(".")[0]
    return float(HOPPER_WORKSPACE if not major.isdigit() or int(major) >= 9 else 4 * 2 ** 20)


# What XLA:GPU's autotuner may allocate on the device while a program compiles: it runs the
# candidate kernels on buffers from the same allocator. Older XLA capped its scratch at 4,096
# MiB (`--xla_gpu_redzone_scratch_max_megabytes`, a flag jaxlib 0.10 no longer has); on an H200
# both rollouts of the paper config at Qwen2.5-0.5B's shape peaked 4.26 and 4.35 GB over their
# plans, about that (docs/results.md).
AUTOTUNE_SCRATCH = 4096 * 2 ** 20
_AUTOTUNE_LEVEL = re.compile(r"--xla_gpu_autotune_level=(\d+)")


def autotune_scratch(device=None, xla_flags: str | None = None) -> float:
    """Bytes of device memory XLA:GPU's autotuner may take while a program compiles, as far as
    measured (`AUTOTUNE_SCRATCH`); 0 off NVIDIA GPUs, and where `xla_flags` (default $XLA_FLAGS)
    turns autotuning off (`--xla_gpu_autotune_level=0`, the last one given). Not among a
    program's buffers, so not in the plan: a run whose programs come from the persistent
    compilation cache does not autotune either."""
    if _nvidia_gpu(device) is None:
        return 0.0
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    level = _AUTOTUNE_LEVEL.findall(flags)
    return 0.0 if level and int(level[-1]) == 0 else float(AUTOTUNE_SCRATCH)


# a cuBLAS call's output tuple ends in its workspace: `(f32[..], s8[33554432]{0}) custom-call(`
_CUBLAS_WORKSPACE = re.compile(r"s8\[(\d+)\]\{0\}\) custom-call\([^\n]*?"
                               r'custom_call_target="__cublas')


def compiled_workspace(compiled) -> int:
    """Bytes of cuBLAS workspace in a compiled program (`jax.jit(...).lower(...).compile()`):
    the largest its cuBLAS calls take, 0 where it has none (CPU, TPU, or a GPU program whose
    matmuls autotuning all gave to Triton fusions, as it can at small shapes: on an H100, some
    of tests/test_memory.py's; Qwen2.5-0.5B's decode loop keeps cuBLAS for its head)."""
    return max(map(int, _CUBLAS_WORKSPACE.findall(compiled.as_text())), default=0)


def plan(run: run_config.RunSpec, cfg: ModelConfig, *, mesh_shape=(1, 1, 1),
         prompt_tokens: int = 256, decode_dtype: str = "float32", update_dtype: str = "float32",
         contexts: tuple[int, int] | None = None, attention: str = "cpu",
         workspace: float = 0.0, shares: tuple[int, int] = (1, 1)) -> list[Phase]:
    """The phases of a run on a (data, fsdp, tensor) mesh, per device. `prompt_tokens`: the
    first turn's prompt length (known once the tokenizer is; 256 is a typical upper value);
    `contexts`: the cache slots of the training and the validation rollouts (what an episode
    can reach, `Rollout.context`; None: rollout.max_context for both, an upper bound);
    `attention`: the update's attention kernels (`model.kernels`; "cudnn" and "splash" keep
    no scores);
    `workspace`: the backend's matmul workspace in every program (`matmul_workspace`);
    `shares`: the training and the validation rollouts' `Rollout.share` (1: every row
    appends its own first prompt, an upper bound). Under
    `trainer.offload_state` the sampling phases leave out the state's `OFFLOADED` parts."""
    data, fsdp, tensor = mesh_shape
    batch_shards, model_shards = data * fsdp, fsdp * tensor
    r, v, algo, settings = run.batch, run.val.batch, run.algo, run.model.lora
    if settings is not None and not cfg.lora_rank:  # a model shape: the config's adapters
        cfg = cfg.replace(lora_rank=int(settings["rank"]), lora_alpha=float(settings["alpha"]),
                          lora_targets=lora.parse_targets(settings["targets"]))
    state = state_parts(algo, cfg, model_shards, update_dtype)
    if workspace:
        state += (("matmul workspace", workspace),)
    offload = run.trainer.offload_state
    sampling = tuple(p for p in state if not (offload and p[0] in OFFLOADED))
    episodes = dict(decode_dtype=decode_dtype, windows=run.rollout.decode_windows,
                    prompt_tokens=prompt_tokens, model_shards=model_shards)
    S, S_val = contexts or (run.rollout.max_context, run.rollout.max_context)
    train_rows, val_rows = r.chunk, v.chunk  # episodes played at once
    kept = algo.static_groups(r.env_groups) * r.group_size
    micro = min(algo.micro_batch_size, kept)
    share = update_lib.static_loss_share(algo, kept, r.env_groups, S)  # the PPO loss packing
    packed = None
    if share > 1:
        groups = update_lib.share_micro(micro, share, min(algo.ppo_mini_batch_size, kept)) // share
        packed = (max(groups / batch_shards, 1), S + (share - 1) * algo.response_length)
    # decode windows hold the cache twice (`cache_copies`): one window holds it once
    windows = ("rollout.decode_windows",) if run.rollout.decode_windows > 1 else ()
    return [
        Phase("rollout",
              sampling + episode_parts(cfg, train_rows / batch_shards, S, share=shares[0],
                                       **episodes),
              ("rollout.batch_size", "rollout.max_context", "mesh.fsdp") + windows
              + (() if offload else ("trainer.offload_state",))),
        Phase("validation",
              sampling + episode_parts(cfg, val_rows / batch_shards, S_val, share=shares[1],
                                       **episodes),
              ("val.batch_size", "val.env_groups", "rollout.max_context", "mesh.fsdp")
              + windows + (() if offload else ("trainer.offload_state",))),
        Phase("update", state + update_parts(
            run.model, algo, cfg, kept / batch_shards, max(micro / batch_shards, 1), S,
            update_dtype=update_dtype, model_shards=model_shards, attention=attention,
            packed=packed),
              ("algorithm.micro_batch_size", "algorithm.logit_chunk_size", "model.remat",
               "rollout.max_context", "mesh.fsdp")),
    ]


def sft_run(run: run_config.RunSpec) -> run_config.RunSpec:
    """`run` as its SFT phase alone plans (`plan`, then `sft_phases`): SFT's optimizer (no
    critic, no reference weights) over `sft.env_groups` demonstrations a step."""
    algo = run.sft.algo.replace(use_kl_loss=False, use_kl_in_reward=False,
                                rollout_filter_ratio=1.0, group_size=1)  # a level a row
    return dataclasses.replace(run, algo=algo, batch=dataclasses.replace(
        run.batch, env_groups=run.sft.env_groups, group_size=1))


def sft_phases(phases: list[Phase]) -> list[Phase]:
    """An `sft_run`'s plan as the SFT phase runs: validation and the SFT update (no batch is
    sampled: the demonstrations are the solver's)."""
    return [dataclasses.replace(p, name="SFT update") if p.name == "update" else p
            for p in phases if p.name != "rollout"]


def prompt_chunks(rollout) -> list[tuple[int, int]]:
    """(prompt prefix tokens, widest observation chunk) of each env a rollout plays: the two
    chunks appended before the first reply."""
    return [(sum(int(t.lengths[t.ids[k]]) for k in ("start", "prefix")),
             dialogue.chunk_width(etext, t))
            for etext, t in zip(rollout.texts, rollout.env_tables)]


def prompt_tokens(rollout) -> int:
    """The longest chunk a rollout appends at once (the prefill scores grow with it)."""
    return max(max(chunks) for chunks in prompt_chunks(rollout))


def describe(phases: list[Phase], capacity: float | None, where: str = "device") -> str:
    """One line per phase: its estimated peak and its biggest part, against the capacity."""
    cap = f" ({where}: {capacity / GB:.1f} GB)" if capacity else ""
    lines = []
    for p in phases:
        what, size = max(p.parts, key=lambda x: x[1])
        lines.append(f"memory plan: {p.name} ~{p.total / GB:.2f} GB per device{cap}; the "
                     f"largest part: {what} {size / GB:.2f} GB")
    return "\n".join(lines)


def check(phases: list[Phase], capacity: float | None, where: str = "device") -> None:
    """MemoryPlanError for the first phase whose estimate exceeds `capacity` (None: unknown)."""
    if not capacity:
        return
    for p in phases:
        if p.total > capacity:
            what, size = max(p.parts, key=lambda x: x[1])
            raise MemoryPlanError(
                f"memory plan: the {p.name} needs ~{p.total / GB:.1f} GB per device, more than "
                f"the {capacity / GB:.1f} GB there are ({where}; the largest part: {what} "
                f"{size / GB:.1f} GB); lower {', '.join(p.knobs)}")


def device_capacity() -> tuple[float | None, str]:
    """(bytes one device can hold, what that is): the accelerator's memory limit, or on CPU
    the host's available memory (shared by every fake CPU device and the process itself)."""
    import jax

    dev = jax.devices()[0]
    if dev.platform != "cpu":
        stats = dev.memory_stats() or {}
        limit = stats.get("bytes_limit")
        return (float(limit), f"{dev.device_kind} memory") if limit else (None, dev.device_kind)
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        available = float(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None, "host memory"
    return available / max(jax.local_device_count(), 1), "host memory available"


def device_stat(key: str) -> float | None:
    """One of the first local device's allocator statistics (`memory_stats()`: bytes_in_use,
    peak_bytes_in_use, ...), or None where the backend reports none (XLA:CPU). A host call: it
    waits for nothing on the device."""
    import jax

    value = (jax.local_devices()[0].memory_stats() or {}).get(key)
    return None if value is None else float(value)


def device_peak() -> float | None:
    """The peak bytes the first local device has held so far (its allocator's
    `peak_bytes_in_use`, a running maximum since the process started), or None where the
    backend reports none (XLA:CPU)."""
    return device_stat("peak_bytes_in_use") or None


def describe_peak(phase: str, peak: float, planned: float | None, scratch: float = 0.0) -> str:
    """One line: the device's measured peak after a phase's first run, beside its plan; where
    the peak is over the plan and the autotuner may have taken `scratch` bytes while compiling
    (`autotune_scratch`), the line says so."""
    plan = f" (plan: ~{planned / GB:.2f} GB)" if planned else ""
    over = ""
    if planned and peak > planned and scratch:
        over = (f"; it may include XLA's autotuning scratch while compiling, up to "
                f"{scratch / GB:.2f} GB")
    return (f"memory measured: {phase} done, the device's peak so far {peak / GB:.2f} GB"
            f"{plan}{over}")


def total_gb(phases: list[Phase]) -> dict[str, float]:
    return {p.name: round(p.total / GB, 3) for p in phases}
