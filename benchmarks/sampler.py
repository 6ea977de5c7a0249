"""Sampler throughput: new tokens per second (prefill included) vs transformers' PyTorch generate.

  python benchmarks/sampler.py --model=smollm2-135m-instruct --batch=64 --prompt_len=256 --new_tokens=128

Every row decodes exactly `new_tokens` tokens at temperature 1 (end-of-sequence ignored), on
both sides. The PyTorch side (when torch is installed) loads the same checkpoint with
transformers and runs `generate` in float32 and bfloat16; the faster is the baseline. The CPU's
matmul peak is measured too, to report what fraction of it the sampler reaches. The last line
printed is one JSON object.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from starpo import sampler, training, weights  # noqa: E402

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


def prompts(tok, batch, length):
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": TEXT * 20}]))[:length]
    rows = np.tile(np.asarray(ids, np.int32), (batch, 1))
    rows[:, 1] = np.arange(batch) % 1000 + 100  # rows differ, so no work is shared
    return rows


def run_jax(m, rows, new_tokens, dtype, prefill_dtype, cache_dtype, repeats):
    cfg = m.cfg.replace(dtype=dtype)
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


def run_torch(model_dir, rows, new_tokens, dtype, repeats):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    x = torch.tensor(rows)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, pad_token_id=0, attention_mask=torch.ones_like(x))
    with torch.no_grad():
        model.generate(x[:, :8], **dict(kw, max_new_tokens=2, min_new_tokens=2))  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            out = model.generate(x, **kw)
            times.append(time.perf_counter() - t)
            assert out.shape[1] == x.shape[1] + new_tokens
    return rows.shape[0] * new_tokens / min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    p.add_argument("--torch", choices=["auto", "no"], default="auto")
    a = p.parse_args()

    if a.prefill_dtype == "auto":
        a.prefill_dtype = training.compute_bound_dtype()
    m = weights.load_model(a.model)
    rows = prompts(m.tokenizer, a.batch, a.prompt_len)
    result = dict(model=a.model, batch=a.batch, prompt_len=int(rows.shape[1]),
                  new_tokens=a.new_tokens, dtype=a.dtype, prefill_dtype=a.prefill_dtype,
                  cache_dtype=a.cache_dtype,
                  device=jax.devices()[0].device_kind)
    tps, compile_s = run_jax(m, rows, a.new_tokens, a.dtype, a.prefill_dtype, a.cache_dtype,
                             a.repeats)
    result.update(tokens_per_s=round(tps, 1), compile_s=round(compile_s, 1))
    print(f"jax: {tps:.1f} new tokens/s (compile {compile_s:.1f}s)", file=sys.stderr, flush=True)

    peak = matmul_peak()
    result["matmul_peak_gflops"] = {k: round(v, 1) for k, v in peak.items()}
    # model FLOPs: 2 per weight per token (prefill + decode) + attention over the context
    c = m.cfg
    attn = 4 * c.num_layers * c.num_heads * c.head_dim * (a.prompt_len + a.new_tokens / 2)
    flops_per_new_token = (2 * c.num_params + attn) * (a.prompt_len + a.new_tokens) / a.new_tokens
    # against the faster of the two peaks (the prefill runs in bfloat16 by default)
    result["fraction_of_matmul_peak"] = round(
        tps * flops_per_new_token / 1e9 / max(peak.values()), 3)

    if a.torch == "auto":
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch not installed: no PyTorch comparison", file=sys.stderr)
        else:
            d = weights.converted_dir(a.model) if a.model in weights.EMBEDDED else a.model
            for dt in ("float32", "bfloat16"):
                t = run_torch(d, rows, a.new_tokens, dt, a.repeats)
                result[f"torch_{dt}_tokens_per_s"] = round(t, 1)
                print(f"torch {dt}: {t:.1f} new tokens/s", file=sys.stderr, flush=True)
            best = max(result["torch_float32_tokens_per_s"], result["torch_bfloat16_tokens_per_s"])
            result["torch_tokens_per_s"] = best
            result["speedup_vs_torch"] = round(tps / best, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
