"""Sampler throughput: new tokens per second (prefill included) vs transformers' PyTorch generate.

  python -m benchmarks.sampler --model=smollm2-135m-instruct --batch=64 --prompt_len=256 --new_tokens=128

Every row decodes exactly `new_tokens` tokens at temperature 1 (end-of-sequence ignored), on
both sides, on the device JAX runs on (PyTorch on CUDA when JAX is on a GPU; no PyTorch side on
a TPU). The PyTorch side (when torch is installed) loads the same checkpoint with transformers
(a `random:` model: the same shape, its own random weights) and runs `generate` in float32 and
bfloat16; the faster is the baseline. The fraction of the device's peak is against a matmul
probe measured here on CPU, else against the device's bfloat16 spec (`BF16_PEAK_TFLOPS`). Peak
memory is the device's on GPU/TPU (both sides), the host RSS on CPU. The last line printed is
one JSON object.

Run from the repository root: `python -m` puts it on the import path.
"""

import json
import os
import resource
import sys
import time

# JAX and PyTorch share this process (and its GPU): JAX takes memory as it needs it
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from starpo import cli, precision, sampler, weights

TEXT = ("You are solving the Sokoban puzzle. You are the player and you need to push all boxes "
        "to targets. When you are right next to a box, you can push it by moving in the same "
        "direction. Turn 1:\nState:\n######\n#___O#\n#_X__#\n#_P__#\n######\n")


def matmul_peak(n=2048, reps=5):
    """GFLOP/s of an n^3 matmul: float32, and bfloat16 inputs accumulating in float32."""
    out = {}
    for name, dt in (("float32", jnp.float32), ("bf16_in_f32_acc", jnp.bfloat16)):
        a = jnp.ones((n, n), dt)
        f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
        f(a, a).block_until_ready()
        t = time.perf_counter()
        for _ in range(reps):
            r = f(a, a)
        r.block_until_ready()
        out[name] = 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9
    return out


# ----------------------------------------------------------------------------- device side
# bfloat16 dense matmul peaks (TFLOP/s, vendor specs) by JAX device kind: the first name in the
# kind wins. Measured matmul rates are lower (an H100 SXM reaches ~790 of its 989).
BF16_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0),
                    ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0),
                    ("TPU v5p", 459.0), ("TPU v5", 459.0), ("TPU v6 lite", 918.0),
                    ("TPU v6e", 918.0))


# memory bandwidth per device kind (first match; spec sheets), TB/s: what a decode step is bound by
HBM_TB_S = (("H100 PCIe", 2.0), ("H100", 3.35), ("H200", 4.8), ("A100", 2.0),
            ("TPU v4", 1.2), ("TPU v5 lite", 0.82), ("TPU v5e", 0.82), ("TPU v5p", 2.76),
            ("TPU v5", 2.76), ("TPU v6 lite", 1.64), ("TPU v6e", 1.64))


def bandwidth_tb_s() -> float | None:
    """The default device's memory bandwidth from `HBM_TB_S`; None where unknown (CPU)."""
    kind = device_kind()
    return next((bw for name, bw in HBM_TB_S if name in kind), None)


def decode_bound(cfg, rows: int, steps: int, mean_fill: float, dtype: str,
                 cache_dtype: str) -> dict:
    """The memory-bandwidth bound of `steps` decode steps of `rows` rows: each step reads every
    weight once (in `dtype`) and each row's filled cache slots (`mean_fill` on average over the
    steps, keys and values of every layer in `cache_dtype`). {"bytes_per_step", "bound_s",
    "formula"}; bound_s None where the bandwidth is unknown."""
    weights_b = cfg.num_params * np.dtype(jnp.dtype(dtype)).itemsize
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(
        cache_dtype).itemsize
    per_step = weights_b + rows * mean_fill * kv_token
    bw = bandwidth_tb_s()
    return dict(
        bytes_per_step=round(per_step), bandwidth_tb_s=bw, decode_steps=steps,
        bound_s=None if bw is None else round(steps * per_step / (bw * 1e12), 4),
        formula=(f"steps {steps} x (weights {weights_b / 1e9:.3f} GB + rows {rows} x mean "
                 f"filled slots {mean_fill:.0f} x {kv_token} B of KV per slot) / {bw} TB/s"))


def device_kind() -> str:
    return jax.devices()[0].device_kind


def torch_device() -> str | None:
    """PyTorch's device for the JAX backend: "cuda", "cpu", or None (a TPU: no comparison)."""
    return {"gpu": "cuda", "cpu": "cpu"}.get(jax.default_backend())


def peak_gflops(dtype: str | None) -> tuple[float | None, str]:
    """(GFLOP/s that utilisation is measured against, where that figure comes from); on CPU the
    probe of `dtype`'s matmuls (None: the faster probe)."""
    if jax.default_backend() == "cpu":
        probe = matmul_peak()
        key = {"bfloat16": "bf16_in_f32_acc", "float32": "float32"}.get(dtype)
        if key is None:  # the faster of the two
            key = max(probe, key=probe.get)
        return probe[key], f"{key} matmul probe measured in this run"
    kind = device_kind()
    for name, tflops in BF16_PEAK_TFLOPS:
        if name.lower() in kind.lower():
            return tflops * 1e3, f"{name} bfloat16 dense spec, {tflops:g} TFLOP/s"
    return None, f"no known peak for {kind}"


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def jax_peak_memory() -> dict:
    """{"peak_memory_gb", "memory"}: the device's peak bytes in use, or the host's peak RSS
    where the device keeps no statistics (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return dict(peak_memory_gb=round(stats["peak_bytes_in_use"] / 1e9, 2), memory="device")
    return dict(peak_memory_gb=round(peak_rss_gb(), 2), memory="host_rss")


def torch_model(spec: str, dtype: str, device: str):
    """The transformers model of a model spec on `device`: the checkpoint, or for `tiny:` /
    `random:` the same shape with its own random weights."""
    import torch
    import transformers

    if device == "cpu":
        torch.set_num_threads(os.cpu_count())
    kind = weights.model_kind(spec)
    if kind in ("tiny", "random"):
        cfg = (weights.random_config(weights._parse_tiny(spec, weights.RANDOM_DEFAULTS))
               if kind == "random" else weights.load_model(spec).cfg)
        hf = weights.hf_config(cfg, weights.Tokenizer.tiny())
        config = transformers.AutoConfig.for_model(**hf)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    else:
        path = weights.converted_dir(spec) if kind == "embedded" else spec
        model = transformers.AutoModelForCausalLM.from_pretrained(path,
                                                                  dtype=getattr(torch, dtype))
    return model.to(device)


def torch_peak_memory(device: str) -> dict:
    import torch

    if device == "cuda":
        return dict(peak_memory_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2),
                    memory="device")
    return dict(peak_memory_gb=round(peak_rss_gb(), 2), memory="host_rss")


def prompts(tok, batch, length):
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": TEXT * 20}]))[:length]
    rows = np.tile(np.asarray(ids, np.int32), (batch, 1))
    rows[:, 1] = np.arange(batch) % 1000 + 100  # rows differ, so no work is shared
    return rows


def run_jax(m, rows, new_tokens, dtype, prefill_dtype, cache_dtype, repeats,
            decode_attention="xla"):
    cfg = m.cfg.replace(dtype=dtype, decode_attention=decode_attention)
    smp = sampler.Sampler(cfg, new_tokens, eos_ids=(), pad_id=m.tokenizer.pad_id,
                          prefill_dtype=prefill_dtype)
    B, P = rows.shape
    chunk, valid = jnp.asarray(rows), jnp.ones(rows.shape, bool)

    def args(seed):
        state = sampler.init_state(cfg, B, P + new_tokens, cache_dtype)
        return (m.params, state, chunk, valid, jax.random.key(seed), jnp.float32(1.0),
                jnp.ones((B,), bool), None)

    t = time.perf_counter()
    program = sampler.run_turn.lower(smp, *args(0), fresh=True).compile()
    compile_s = time.perf_counter() - t
    times = []
    for r in range(repeats):
        a = args(r)
        jax.block_until_ready(a)
        t = time.perf_counter()
        _, turn = program(*a)
        turn.tokens.block_until_ready()
        times.append(time.perf_counter() - t)
        assert int(turn.length.min()) == new_tokens
    return B * new_tokens / min(times), compile_s


def run_torch(spec, rows, new_tokens, dtype, repeats, device):
    import torch

    model = torch_model(spec, dtype, device).eval()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    x = torch.tensor(rows).to(device)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, pad_token_id=0, attention_mask=torch.ones_like(x))
    with torch.no_grad():
        model.generate(x[:, :8], **dict(kw, max_new_tokens=2, min_new_tokens=2))  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            out = model.generate(x, **kw)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            assert out.shape[1] == x.shape[1] + new_tokens
    return rows.shape[0] * new_tokens / min(times), torch_peak_memory(device)


def compare_torch(a, rows, result) -> None:
    """PyTorch generate on JAX's device in float32 and bfloat16: tokens/s and peak memory."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch not installed: no PyTorch comparison", file=sys.stderr)
        return
    device = torch_device()
    if device is None:
        print(f"no PyTorch comparison on {jax.default_backend()}", file=sys.stderr)
        return
    for dt in ("float32", "bfloat16"):
        t, mem = run_torch(a.model, rows, a.new_tokens, dt, a.repeats, device)
        result[f"torch_{dt}_tokens_per_s"] = round(t, 1)
        result[f"torch_{dt}_peak_memory_gb"] = mem["peak_memory_gb"]
        print(f"torch {dt} on {device}: {t:.1f} new tokens/s", file=sys.stderr, flush=True)
    best = max(("float32", "bfloat16"), key=lambda d: result[f"torch_{d}_tokens_per_s"])
    result["torch_tokens_per_s"] = result[f"torch_{best}_tokens_per_s"]
    result["torch_device"] = device
    result["speedup_vs_torch"] = round(result["tokens_per_s"] / result["torch_tokens_per_s"], 2)


def main():
    p = cli.ArgParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt_len", type=int, default=256)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", help="decode matmul input dtype")
    p.add_argument("--prefill_dtype", default="auto",
                   help="prompt (prefill) matmul input dtype; accumulation is always float32. "
                        "auto: what training uses here (bfloat16 on GPU/TPU and on CPUs with "
                        "native bfloat16, else float32)")
    p.add_argument("--cache_dtype", default="float32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--decode_attention", choices=["xla", "pallas"], default="xla",
                   help="a decode step's attention: XLA's ops or the fused kernel "
                        "(starpo/decode_attention.py; interpreted off a GPU: slow)")
    p.add_argument("--torch", choices=["auto", "no"], default="auto")
    a = p.parse_args()
    for flag in ("batch", "prompt_len", "new_tokens", "repeats"):
        p.check(getattr(a, flag) >= 1, f"--{flag} must be >= 1, got {getattr(a, flag)}")
    p.dtype(a.dtype, "--dtype")
    p.dtype(a.cache_dtype, "--cache_dtype")
    p.dtype(a.prefill_dtype, "--prefill_dtype", ("auto", "float32", "bfloat16"))
    p.model(a.model)

    if a.prefill_dtype == "auto":
        a.prefill_dtype = precision.compute_bound_dtype()
    m = weights.load_model(a.model)
    rows = prompts(m.tokenizer, a.batch, a.prompt_len)
    c = m.cfg
    result = dict(model=a.model, params=c.num_params, device=device_kind(), batch=a.batch,
                  prompt_len=int(rows.shape[1]), new_tokens=a.new_tokens, dtype=a.dtype,
                  prefill_dtype=a.prefill_dtype, cache_dtype=a.cache_dtype,
                  decode_attention=a.decode_attention)
    tps, compile_s = run_jax(m, rows, a.new_tokens, a.dtype, a.prefill_dtype, a.cache_dtype,
                             a.repeats, a.decode_attention)
    result.update(tokens_per_s=round(tps, 1), compile_s=round(compile_s, 1), **jax_peak_memory())
    # the decode loop against the memory bandwidth: prefill's time counts against it too
    bound = decode_bound(c, a.batch, a.new_tokens, rows.shape[1] + a.new_tokens / 2, a.dtype,
                         a.cache_dtype)
    result["decode_bound"] = bound
    if bound["bound_s"]:
        result["fraction_of_bandwidth_bound"] = round(
            bound["bound_s"] * tps / (a.batch * a.new_tokens), 3)
    print(f"jax: {tps:.1f} new tokens/s (compile {compile_s:.1f}s)", file=sys.stderr, flush=True)

    # model FLOPs: 2 per weight per token (prefill + decode) + attention over the context
    attn = 4 * c.num_layers * c.num_heads * c.head_dim * (a.prompt_len + a.new_tokens / 2)
    flops_per_new_token = (2 * c.num_params + attn) * (a.prompt_len + a.new_tokens) / a.new_tokens
    # on CPU against the faster of the two probes (decode and prefill dtypes may differ)
    peak, result["peak_source"] = peak_gflops(None)
    if peak:
        result["fraction_of_peak"] = round(tps * flops_per_new_token / 1e9 / peak, 4)

    if a.torch == "auto":
        compare_torch(a, rows, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
