"""Update step throughput and memory: the policy's forward + backward + AdamW, against a plain
PyTorch training step of the same checkpoint.

  python -m benchmarks.update --model=smollm2-135m-instruct --batch=8 --seq_len=512
  python -m benchmarks.update --logit_chunk=128 --compare_logit_chunk=0 --torch=no
  python -m benchmarks.update --profile=/tmp/update_profile --torch=no   # where a step's time goes

With `--lora_rank=R` a second JAX worker trains LoRA adapters of rank R (`starpo/lora.py`: the
base frozen in the matmul dtype, float32 adapters and their AdamW moments) on the same batch, in
its own process: `lora_*` beside the full fine-tuning figures, and the measured bytes per base
weight of each (peak over parameters).

With `--compare_logit_chunk` the JAX worker compiles a second step with that log-prob head chunk
and times the two in turn, step by step in one process, so a busy machine slows both alike:
`step_s_over_compare` is the cost of the chunking.

The JAX side is the actor half of the StarPO update (`update_lib.make_grad_fn`: PPO loss over
token log-probs, micro-batch gradient accumulation, per-layer rematerialisation, chunked
log-prob head) followed by the optimiser (global-norm clip + AdamW), one jitted step with donated
weights and optimiser state. The PyTorch side is what a user would otherwise write: the
transformers model (a `random:` model: the same shape, its own random weights), a cross-entropy
loss over the same tokens, `loss.backward()`, AdamW; in float32 and with bfloat16 autocast, on
the device JAX runs on (CUDA when JAX is on a GPU; no PyTorch side on a TPU). Every variant
runs in its own process, so each peak memory is its own: the device's on GPU/TPU, the host RSS
on CPU (`memory` says which). FLOPs utilisation is model FLOPs (6 per weight per token plus
causal attention, rematerialisation not counted) over a matmul peak measured in the run on CPU,
else over the device's bfloat16 spec (`benchmarks/sampler.py`'s BF16_PEAK_TFLOPS;
`peak_source` says which). The last line printed is one JSON object.

Run from the repository root: `python -m` puts it on the import path.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from starpo import cli



def random_tokens(batch, seq_len, vocab, seed=0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, (batch, seq_len)).astype(np.int32)


# ----------------------------------------------------------------------------- workers
def worker_jax(a) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from starpo import run_config
    from starpo import lora
    from starpo import update as update_lib
    from starpo import weights

    m = weights.load_model(a.model, dtype=a.dtype, remat=a.remat, remat_policy=a.remat_policy,
                           attention=a.attention)
    cfg, B, T, base_params = m.cfg, a.batch, a.seq_len, m.params
    if a.lora_rank:  # adapters on the base, frozen in the matmul dtype
        cfg, base_params = lora.attach(cfg, m.params, a.lora_rank, a.lora_alpha, a.lora_targets,
                                       jax.random.key(0), base_dtype=a.dtype)
    del m
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(random_tokens(B, T, cfg.vocab_size))
    mask = jnp.ones((B, T), bool).at[:, 0].set(False)
    batch = update_lib.Batch(tokens=tokens, valid=jnp.ones((B, T), bool), loss_mask=mask,
                             old_logprobs=jnp.full((B, T), -2.0, jnp.float32),
                             ref_logprobs=None, old_values=None,
                             returns=jnp.zeros((B, T), jnp.float32),
                             advantages=jnp.asarray(rng.standard_normal((B, T)), jnp.float32))

    def build(chunk):
        """(compiled step, its own weights and optimizer state, compile seconds)."""
        algo = run_config.AlgoConfig(adv_estimator="grpo", ppo_mini_batch_size=B,
                                     micro_batch_size=a.micro_batch,
                                     logit_chunk_size=chunk, actor_lr=1e-6)
        grads_fn = update_lib.make_grad_fn(algo, cfg)
        tx = update_lib.make_optimizer(algo.actor_lr, algo)

        def step(params, opt_state, mb):
            g, _, metrics = grads_fn(params, None, mb)  # the trainable part's (LoRA: adapters)
            params, opt_state = lora.apply_updates(tx, params, opt_state, g)
            return params, opt_state, metrics["actor/loss"]

        params = jax.tree_util.tree_map(jnp.copy, base_params)
        opt_state = tx.init(lora.split(params)[0])
        t = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state,
                                                              batch).compile()
        return [compiled, params, opt_state], time.perf_counter() - t

    # --compare_logit_chunk: a second step, timed in turn with the first (same process, same
    # load), so that the two step times differ by the chunking alone
    chunks = [a.logit_chunk] + ([a.compare_logit_chunk] if a.compare_logit_chunk >= 0 else [])
    runs, compile_s = zip(*[build(c) for c in chunks])
    times = [[] for _ in chunks]
    for i in range(a.steps + 1):  # the first call warms up
        for j, r in enumerate(runs):
            t = time.perf_counter()
            r[1], r[2], loss = r[0](r[1], r[2], batch)
            loss.block_until_ready()
            times[j].append(time.perf_counter() - t)
            print(f"  jax step {i} (logit_chunk {chunks[j]}): {times[j][-1]:.2f} s "
                  f"(loss {float(loss):.4f})", file=sys.stderr, flush=True)
    from benchmarks.sampler import jax_peak_memory

    compared = {} if len(chunks) == 1 else dict(compare_step_s=min(times[1][1:]))
    if a.profile:
        compared["profile"] = profile_step(runs[0], batch, a.profile)
    return dict(step_s=min(times[0][1:]), compile_s=compile_s[0], **compared,
                **jax_peak_memory(), cfg=dict(
        num_params=cfg.num_params, layers=cfg.num_layers, heads=cfg.num_heads,
        head_dim=cfg.head_dim, trained_params=lora.num_adapter_params(cfg) or cfg.num_params))


def profile_step(run, batch, folder: str) -> dict:
    """`decode_step.traced_profile` of one more step of `run` ([compiled, params, opt_state],
    updated in place: the step donates them): where the step's device time goes by kernel and
    by kind (matmuls, attention, elementwise, ...), and its busy fraction (near 1: the kernels
    are the cost, not the host)."""
    from benchmarks import decode_step

    def step():
        run[1], run[2], loss = run[0](run[1], run[2], batch)
        loss.block_until_ready()

    try:
        return decode_step.traced_profile(step, folder, 1)
    except Exception as e:  # the timings stand without it
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


def worker_torch(a, autocast: bool) -> dict:
    import torch

    from benchmarks.sampler import torch_model, torch_peak_memory

    device = a.torch_device
    model = torch_model(a.model, "float32", device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.tensor(random_tokens(a.batch, a.seq_len, model.config.vocab_size),
                     dtype=torch.long).to(device)
    times = []
    for i in range(a.steps + 1):
        t = time.perf_counter()
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        print(f"  torch{' bf16 autocast' if autocast else ' fp32'} step {i}: {times[-1]:.2f} s "
              f"(loss {loss.item():.4f})", file=sys.stderr, flush=True)
    return dict(step_s=min(times[1:]), **torch_peak_memory(device))


def setup_worker(a) -> dict:
    """Fetch / convert an embedded model once, outside the timed workers; the matmul dtype
    "auto" stands for here; the device's kind, PyTorch's device for it (None: no comparison),
    and the peak MFU is measured against with its source. (The main process never starts JAX,
    which on a GPU would hold memory the workers need.)"""
    import jax

    from benchmarks.sampler import device_kind, peak_gflops, torch_device
    from starpo import precision, weights

    if weights.model_kind(a.model) == "embedded":
        weights.converted_dir(a.model)
    dtype = precision.compute_bound_dtype() if a.dtype == "auto" else a.dtype
    peak, source = peak_gflops(dtype)
    return dict(dtype=dtype, device=device_kind(), backend=jax.default_backend(),
                torch_device=torch_device(), peak_gflops=peak, peak_source=source)


WORKERS = {"jax": worker_jax, "torch_float32": lambda a: worker_torch(a, False),
           "torch_bf16_autocast": lambda a: worker_torch(a, True), "setup": setup_worker}


def run_worker(name: str, argv: list[str]) -> dict:
    print(f"{name}:", file=sys.stderr, flush=True)
    env = dict(os.environ)
    if name.startswith("torch"):  # the PyTorch workers read only shapes through starpo
        env["JAX_PLATFORMS"] = "cpu"
    # the worker runs as this process does: `-m benchmarks.update` (from the repository root) or,
    # with the packages installed, as a file
    me = ["-m", __spec__.name] if __spec__ else [os.path.abspath(__file__)]
    p = subprocess.run([sys.executable, *me, f"--worker={name}", *argv],
                       stdout=subprocess.PIPE, text=True, env=env)
    if p.returncode:
        raise SystemExit(f"error: the {name} worker failed (exit {p.returncode})")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- main
def main():
    p = cli.ArgParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--micro_batch", type=int, default=2, help="rows per forward/backward")
    p.add_argument("--logit_chunk", type=int, default=0,
                   help="tokens per log-prob head chunk (0: whole rows of a micro-batch)")
    p.add_argument("--compare_logit_chunk", type=int, default=-1,
                   help="also time a step with this logit chunk, in turn with the first one "
                        "(-1: none); the peak memory is then the two steps' together")
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
    p.add_argument("--attention", default="auto",
                   help="model.attention: auto | cpu | xla | cudnn (the kernels)")
    p.add_argument("--lora_rank", type=int, default=0,
                   help="also time LoRA adapters of this rank (0: full fine-tuning only)")
    p.add_argument("--lora_alpha", type=float, default=64.0)
    p.add_argument("--lora_targets", default="all-linear",
                   help="model.lora.target_modules of the LoRA run")
    p.add_argument("--profile", default="",
                   help="also trace one more JAX step with jax.profiler into this folder and "
                        "report its device time by kernel and kind (`profile`)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--torch_device", default="cpu", help=argparse.SUPPRESS)
    a = p.parse_args()
    for flag in ("batch", "seq_len", "micro_batch", "steps"):
        p.check(getattr(a, flag) >= 1, f"--{flag} must be >= 1, got {getattr(a, flag)}")
    a.micro_batch = min(a.micro_batch, a.batch)
    p.check(a.batch % a.micro_batch == 0,
            f"--micro_batch {a.micro_batch} does not divide --batch {a.batch}")
    p.check(a.logit_chunk >= 0 and a.compare_logit_chunk >= -1,
            "--logit_chunk must be >= 0 and --compare_logit_chunk >= -1")
    p.check(a.remat in (0, 1), f"--remat must be 1 or 0, got {a.remat}")
    p.dtype(a.dtype, "--dtype", ("auto", "float32", "bfloat16"))
    from starpo import model as model_lib

    p.check(a.attention in model_lib.ATTENTION,
            f"--attention must be one of {', '.join(model_lib.ATTENTION)}, got {a.attention!r}")
    p.model(a.model)
    p.check(a.lora_rank >= 0 and a.lora_alpha > 0, f"--lora_rank must be >= 0 and "
            f"--lora_alpha > 0, got {a.lora_rank} and {a.lora_alpha}")
    unknown = [v for v in a.torch_variants.split(",") if f"torch_{v}" not in WORKERS]
    p.check(not unknown, f"unknown --torch_variants entry {unknown[:1]} (float32, bf16_autocast)")
    if a.worker:
        print(json.dumps(WORKERS[a.worker](a)))
        return

    argv = [f"--model={a.model}", f"--batch={a.batch}", f"--seq_len={a.seq_len}",
            f"--micro_batch={a.micro_batch}", f"--logit_chunk={a.logit_chunk}",
            f"--compare_logit_chunk={a.compare_logit_chunk}",
            f"--remat={a.remat}", f"--remat_policy={a.remat_policy}", f"--steps={a.steps}",
            f"--attention={a.attention}"]
    setup = run_worker("setup", argv + [f"--dtype={a.dtype}"])
    p.check(a.attention != "cudnn" or setup["backend"] == "gpu",
            f"--attention=cudnn needs an NVIDIA GPU; JAX runs on {setup['backend']} here")
    argv += [f"--dtype={setup['dtype']}", f"--torch_device={setup['torch_device']}"]
    tokens = a.batch * a.seq_len
    jx = run_worker("jax", argv + ["--lora_rank=0"]
                    + ([f"--profile={os.path.abspath(a.profile)}"] if a.profile else []))
    c = jx.pop("cfg")
    # model FLOPs per trained token: 6 per weight (forward 2, backward 4) plus causal attention
    # scores and mixing (4 * layers * heads * head_dim * T/2 forward, x3 with the backward)
    flops_per_token = 6 * c["num_params"] + 6 * c["layers"] * c["heads"] * c["head_dim"] * a.seq_len
    result = dict(model=a.model, params=c["num_params"], device=setup["device"],
                  dtype=setup["dtype"], attention=a.attention, batch=a.batch, seq_len=a.seq_len,
                  micro_batch=a.micro_batch, remat=bool(a.remat), remat_policy=a.remat_policy,
                  logit_chunk=a.logit_chunk,
                  tokens_per_s=round(tokens / jx["step_s"], 1), step_s=round(jx["step_s"], 2),
                  compile_s=round(jx["compile_s"], 1), peak_memory_gb=jx["peak_memory_gb"],
                  memory=jx["memory"], peak_source=setup["peak_source"])
    if "compare_step_s" in jx:  # the other chunk size's step, timed in turn in one process
        result.update(compare_logit_chunk=a.compare_logit_chunk,
                      compare_step_s=round(jx["compare_step_s"], 2),
                      compare_tokens_per_s=round(tokens / jx["compare_step_s"], 1),
                      step_s_over_compare=round(jx["step_s"] / jx["compare_step_s"], 3))
    if "profile" in jx:  # one more step's kernels: the matmuls' share of its device time
        prof = result["profile"] = jx["profile"]
        if prof.get("busy_s"):
            result["matmul_share"] = round(prof["by_kind"].get("matmul", 0.0)
                                           / prof["busy_s"], 3)
    if setup["peak_gflops"]:
        # three significant figures: a tiny model on a large GPU is far below 0.001
        mfu = result["tokens_per_s"] * flops_per_token / 1e9 / setup["peak_gflops"]
        result["mfu"] = float(f"{mfu:.3g}")
    if a.lora_rank:  # the same step training adapters only, in its own process
        lo = run_worker("jax", argv + [f"--lora_rank={a.lora_rank}",
                                       f"--lora_alpha={a.lora_alpha}",
                                       f"--lora_targets={a.lora_targets}"])
        result.update(lora_rank=a.lora_rank, lora_targets=a.lora_targets,
                      lora_trained_params=lo["cfg"]["trained_params"],
                      lora_tokens_per_s=round(tokens / lo["step_s"], 1),
                      lora_step_s=round(lo["step_s"], 2),
                      lora_peak_memory_gb=lo["peak_memory_gb"],
                      lora_over_full_tokens_per_s=round(jx["step_s"] / lo["step_s"], 3),
                      lora_over_full_peak_memory=round(lo["peak_memory_gb"]
                                                       / jx["peak_memory_gb"], 3))
    if a.torch == "auto":
        compare_torch(a, argv, setup, result)
    print(json.dumps(result))


def compare_torch(a, argv, setup, result) -> None:
    """The PyTorch variants on JAX's device: tokens/s and peak memory of the fastest."""
    if setup["torch_device"] is None:
        print(f"no PyTorch comparison on {setup['backend']}", file=sys.stderr)
        return
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print("torch not installed: no PyTorch comparison", file=sys.stderr)
        return
    tokens = a.batch * a.seq_len
    names = [f"torch_{v}" for v in a.torch_variants.split(",")]
    for name in names:
        r = run_worker(name, argv)
        result[f"{name}_tokens_per_s"] = round(tokens / r["step_s"], 1)
        result[f"{name}_peak_memory_gb"] = r["peak_memory_gb"]
    best = max(names, key=lambda n: result[f"{n}_tokens_per_s"])
    result["torch_device"] = setup["torch_device"]
    result["torch_tokens_per_s"] = result[f"{best}_tokens_per_s"]
    result["torch_peak_memory_gb"] = result[f"{best}_peak_memory_gb"]
    result["speedup_vs_torch"] = round(result["tokens_per_s"] / result["torch_tokens_per_s"], 2)
    result["memory_vs_torch"] = round(result["peak_memory_gb"] / result["torch_peak_memory_gb"], 2)


if __name__ == "__main__":
    main()
