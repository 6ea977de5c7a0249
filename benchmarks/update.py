"""Update step throughput and memory: the policy's forward + backward + AdamW, against a plain
PyTorch training step of the same checkpoint.

  python benchmarks/update.py --model=smollm2-135m-instruct --batch=8 --seq_len=512

The JAX side is the actor half of the StarPO update (`trainer.make_grad_fn`: PPO loss over
token log-probs, micro-batch gradient accumulation, per-layer rematerialisation, chunked
log-prob head) followed by the optimiser (global-norm clip + AdamW), one jitted step with donated
weights and optimiser state. The PyTorch side is what a user would otherwise write: the
transformers model, a cross-entropy loss over the same tokens, `loss.backward()`, AdamW; in
float32 and with bfloat16 autocast. Every variant runs in its own process, so each peak RSS is
its own. FLOPs utilisation is model FLOPs (6 per weight per token plus causal attention,
rematerialisation not counted) over the CPU's measured matmul peak. The last line printed is one
JSON object.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def random_tokens(batch, seq_len, vocab, seed=0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, (batch, seq_len)).astype(np.int32)


# ----------------------------------------------------------------------------- workers
def worker_jax(a) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from starpo import trainer, weights

    m = weights.load_model(a.model, dtype=a.dtype, remat=a.remat, remat_policy=a.remat_policy)
    cfg, B, T = m.cfg, a.batch, a.seq_len
    algo = trainer.AlgoConfig(adv_estimator="grpo", ppo_mini_batch_size=B,
                              micro_batch_size=a.micro_batch, logit_chunk_size=a.logit_chunk,
                              actor_lr=1e-6)
    grads_fn = trainer.make_grad_fn(algo, cfg)
    tx = trainer.make_optimizer(algo.actor_lr, algo)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(random_tokens(B, T, cfg.vocab_size))
    mask = jnp.ones((B, T), bool).at[:, 0].set(False)
    batch = trainer.Batch(tokens=tokens, valid=jnp.ones((B, T), bool), loss_mask=mask,
                          old_logprobs=jnp.full((B, T), -2.0, jnp.float32), ref_logprobs=None,
                          old_values=None, returns=jnp.zeros((B, T), jnp.float32),
                          advantages=jnp.asarray(rng.standard_normal((B, T)), jnp.float32))

    def step(params, opt_state, mb):
        g, _, metrics = grads_fn(params, None, mb)
        updates, opt_state = tx.update(g, opt_state, params)
        return jax.tree_util.tree_map(jnp.add, params, updates), opt_state, metrics["actor/loss"]

    step = jax.jit(step, donate_argnums=(0, 1))
    params = m.params
    opt_state = tx.init(params)
    t = time.perf_counter()
    compiled = step.lower(params, opt_state, batch).compile()
    compile_s = time.perf_counter() - t
    times = []
    for i in range(a.steps + 1):  # the first call warms up
        t = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, batch)
        loss.block_until_ready()
        times.append(time.perf_counter() - t)
        print(f"  jax step {i}: {times[-1]:.2f} s (loss {float(loss):.4f})", file=sys.stderr,
              flush=True)
    return dict(step_s=min(times[1:]), compile_s=compile_s, cfg=dict(
        num_params=cfg.num_params, layers=cfg.num_layers, heads=cfg.num_heads,
        head_dim=cfg.head_dim))


def worker_torch(a, autocast: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from starpo import weights

    torch.set_num_threads(os.cpu_count())
    path = weights.converted_dir(a.model) if a.model in weights.EMBEDDED else a.model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.tensor(random_tokens(a.batch, a.seq_len, model.config.vocab_size), dtype=torch.long)
    times = []
    for i in range(a.steps + 1):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        print(f"  torch{' bf16 autocast' if autocast else ' fp32'} step {i}: {times[-1]:.2f} s "
              f"(loss {loss.item():.4f})", file=sys.stderr, flush=True)
    return dict(step_s=min(times[1:]))


def matmul_peak_worker(a) -> dict:
    from benchmarks.sampler import matmul_peak

    return {k: round(v, 1) for k, v in matmul_peak().items()}


WORKERS = {"jax": worker_jax, "torch_float32": lambda a: worker_torch(a, False),
           "torch_bf16_autocast": lambda a: worker_torch(a, True), "peak": matmul_peak_worker}


def run_worker(name: str, argv: list[str]) -> dict:
    print(f"{name}:", file=sys.stderr, flush=True)
    p = subprocess.run([sys.executable, os.path.abspath(__file__), f"--worker={name}", *argv],
                       stdout=subprocess.PIPE, text=True)
    if p.returncode:
        raise SystemExit(f"error: the {name} worker failed (exit {p.returncode})")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- main
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--micro_batch", type=int, default=2, help="rows per forward/backward")
    p.add_argument("--logit_chunk", type=int, default=0,
                   help="tokens per log-prob head chunk (0: whole rows of a micro-batch)")
    p.add_argument("--dtype", default="auto",
                   help="JAX matmul input dtype (accumulation and master weights stay float32); "
                        "auto: what training uses here (bfloat16 on GPU/TPU and on CPUs with "
                        "native bfloat16, else float32)")
    p.add_argument("--remat", type=int, default=1, help="rematerialise each layer (1/0)")
    p.add_argument("--remat_policy", default="save_dense", choices=["full", "save_dense"],
                   help="what a rematerialised layer keeps (model.remat_policy; the cpu "
                        "configs' save_dense)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--torch", choices=["auto", "no"], default="auto")
    p.add_argument("--torch_variants", default="float32,bf16_autocast",
                   help="PyTorch steps to time (bfloat16 autocast is very slow on CPUs "
                        "without native bfloat16)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    unknown = [v for v in a.torch_variants.split(",") if f"torch_{v}" not in WORKERS]
    if unknown:
        raise SystemExit(f"error: unknown --torch_variants entry {unknown[0]!r} "
                         "(float32, bf16_autocast)")
    if a.worker:
        out = WORKERS[a.worker](a)
        out["peak_rss_gb"] = round(peak_rss_gb(), 2)
        print(json.dumps(out))
        return

    from starpo import training, weights

    if a.dtype == "auto":
        a.dtype = training.compute_bound_dtype()
    weights.load_model(a.model)  # fetch / convert once, outside the timed workers
    argv = [f"--model={a.model}", f"--batch={a.batch}", f"--seq_len={a.seq_len}",
            f"--micro_batch={a.micro_batch}", f"--logit_chunk={a.logit_chunk}",
            f"--dtype={a.dtype}", f"--remat={a.remat}", f"--remat_policy={a.remat_policy}",
            f"--steps={a.steps}"]
    tokens = a.batch * a.seq_len
    jx = run_worker("jax", argv)
    c = jx.pop("cfg")
    # model FLOPs per trained token: 6 per weight (forward 2, backward 4) plus causal attention
    # scores and mixing (4 * layers * heads * head_dim * T/2 forward, x3 with the backward)
    flops_per_token = 6 * c["num_params"] + 6 * c["layers"] * c["heads"] * c["head_dim"] * a.seq_len
    result = dict(model=a.model, batch=a.batch, seq_len=a.seq_len, micro_batch=a.micro_batch,
                  dtype=a.dtype, remat=bool(a.remat), remat_policy=a.remat_policy,
                  logit_chunk=a.logit_chunk,
                  tokens_per_s=round(tokens / jx["step_s"], 1), step_s=round(jx["step_s"], 2),
                  compile_s=round(jx["compile_s"], 1), peak_rss_gb=jx["peak_rss_gb"])
    peak = run_worker("peak", argv)
    peak.pop("peak_rss_gb")
    result["matmul_peak_gflops"] = peak
    best_peak = peak["bf16_in_f32_acc"] if a.dtype == "bfloat16" else peak["float32"]
    result["mfu"] = round(result["tokens_per_s"] * flops_per_token / 1e9 / best_peak, 3)

    if a.torch == "auto":
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        except ImportError:
            print("torch not installed: no PyTorch comparison", file=sys.stderr)
        else:
            names = [f"torch_{v}" for v in a.torch_variants.split(",")]
            for name in names:
                r = run_worker(name, argv)
                result[f"{name}_tokens_per_s"] = round(tokens / r["step_s"], 1)
                result[f"{name}_peak_rss_gb"] = r["peak_rss_gb"]
            best = max(names, key=lambda n: result[f"{n}_tokens_per_s"])
            result["torch_tokens_per_s"] = result[f"{best}_tokens_per_s"]
            result["torch_peak_rss_gb"] = result[f"{best}_peak_rss_gb"]
            result["speedup_vs_torch"] = round(result["tokens_per_s"]
                                               / result["torch_tokens_per_s"], 2)
            result["memory_vs_torch"] = round(result["peak_rss_gb"]
                                              / result["torch_peak_rss_gb"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
