"""RAGEN-2's gradient analysis (RAGEN `ragen/trainer/gradient_reporter.py`, the buckets of
`rollout_filter.py` `split_into_buckets`, the component passes of `workers/actor/dp_actor.py`):
on its steps, before the update, the prepared batch's kept groups are split into buckets by
their in-group reward std, and each bucket's gradient of each loss term is measured with the
current policy, without an optimizer step. It shows where the update's signal comes from: in
RAGEN-2's reading, low-variance groups give small task gradients and the regularisers'
gradients dominate them.

    buckets    `all` (every kept row), then bucket_1 (lowest std) .. bucket_n (highest):
               `quantile`: the kept groups sorted by std (ties by index) in n equal shares
               (n = min(trainer.gradient_analysis_num_buckets, kept groups); the last takes the
               remainder), or `fixed_rv`: std in [0,1), [1,2), .. [4,5), [5, inf)
    components task (the clipped policy loss), entropy (-entropy_coeff x entropy; when the
               coefficient is not 0), kl (kl_loss_coef x the KL loss; with use_kl_loss)
    a bucket's rows, in row order, run in mini-batches of `ppo_mini_batch_size` (the last one
    shorter), as verl splits the sub-batch; each mini-batch's gradient of each component is
    summed over its micro-batches, and its global L2 norm (what clipping would see) is averaged
    over the mini-batches.

Logged as RAGEN-2 names them: grad_norm/<bucket>/<component> (and /per_sample/, /per_token/:
over the bucket's rows and model tokens), grad_norm/<bucket>/loss/{policy,entropy,kl,total},
grad_norm/<bucket>/sample_count, sample_pct, reward_std_mean / _min / _max; the `all` bucket's
also as actor/grad_norm/<component> and actor/loss/<name>. Not here: RAGEN-2's pre-filter pass
and its separate analysis rollout (`gradient_analysis_env_groups`). Its losses are those of
each mini-batch (RAGEN-2 averages its micro-batches'), with this update's loss aggregation.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax

from starpo import lora, losses
from starpo import update as update_lib

from starpo.schema import BUCKET_MODES  # noqa: F401
FIXED_EDGES = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)  # RAGEN-2's fixed_rv intervals' lower ends


def group_buckets(std: jax.Array, kept: jax.Array, count: int, mode: str = "quantile"):
    """int32[G]: each group's bucket (0-based; -1 for a group not kept) from its reward std
    f32[G] and kept bool[G]; see the module docstring. Returns (bucket, number of buckets)."""
    if mode not in BUCKET_MODES:
        raise ValueError(f"unknown gradient_analysis_bucket_mode {mode!r} (one of "
                         f"{BUCKET_MODES})")
    if mode == "fixed_rv":
        bucket = (std[:, None] >= jnp.asarray(FIXED_EDGES)[None, :]).sum(axis=1) - 1
        return jnp.where(kept, bucket, -1).astype(jnp.int32), len(FIXED_EDGES)
    G = std.shape[0]
    n = kept.sum()
    buckets = jnp.maximum(jnp.minimum(count, n), 1)
    per = jnp.maximum(n // buckets, 1)
    order = jnp.argsort(jnp.where(kept, std, jnp.inf), stable=True)
    rank = jnp.zeros(G, jnp.int32).at[order].set(jnp.arange(G, dtype=jnp.int32))
    bucket = jnp.minimum(rank // per, buckets - 1)
    return jnp.where(kept, bucket, -1).astype(jnp.int32), count


def components(algo) -> list[str]:
    """The loss terms a config has, as RAGEN-2 measures them: task, then entropy where the
    coefficient is not 0, then kl with the KL loss."""
    return ["task"] + (["entropy"] if algo.entropy_coeff != 0 else []) + (
        ["kl"] if algo.use_kl_loss else [])


def make_analysis(algo, actor_cfg, count: int = 6, mode: str = "quantile",
                  compiler_options=None):
    """jitted analyse(actor_params, batch: update.Batch) -> dict of arrays: per bucket (`all`
    first) the mean gradient norm and loss of each of `components(algo)` over its mini-batches,
    its row and token counts and its reward stds. `batch` is `update.make_prepare`'s."""
    vgs = {c: lora.value_and_grad(functools.partial(update_lib.actor_loss, algo, actor_cfg,
                                                    component=c), has_aux=True)
           for c in components(algo)}

    def chunk(params, mb):
        """Every component's (gradient norm, loss) of one mini-batch, summed over micro-batches
        (their denominators are the mini-batch's)."""
        num_tokens, num_seqs = losses.denominators(mb.loss_mask)
        micro = update_lib.micro_size(algo, mb.tokens.shape[0])
        out = {}
        for c, vg in vgs.items():
            def add(acc, m, vg=vg):
                (loss, _), g = vg(params, m, num_tokens, num_seqs)
                return jax.tree_util.tree_map(jnp.add, acc, (loss, g)), None
            zero = (jnp.zeros((), jnp.float32),
                    jax.tree_util.tree_map(jnp.zeros_like, lora.split(params)[0]))
            (loss, g), _ = jax.lax.scan(add, zero, update_lib.micro_split(mb, micro))
            out[c] = (optax.global_norm(g), loss)
        return out

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def analyse(params, batch):
        N = batch.tokens.shape[0]
        G = N // algo.group_size
        mini = min(algo.ppo_mini_batch_size, N)
        chunks = math.ceil(N / mini)
        kept_rows = jnp.ones(N, bool) if batch.keep is None else batch.keep
        grouped = lambda x: x.reshape(G, algo.group_size)[:, 0]  # noqa: E731
        bucket_g, n_buckets = group_buckets(grouped(batch.group_std), grouped(kept_rows), count,
                                            mode)
        bucket_row = jnp.repeat(bucket_g, algo.group_size)
        total_rows = kept_rows.sum()

        def one(k):  # bucket k - 1 (k = 0: every kept row)
            inside = kept_rows & ((bucket_row == k - 1) | (k == 0))
            n = inside.sum()
            order = jnp.argsort(~inside, stable=True)  # its rows first, in row order
            order = jnp.pad(order, (0, chunks * mini - N))

            def run(c):
                rows = jax.lax.dynamic_slice(order, (c * mini,), (mini,))
                real = c * mini + jnp.arange(mini) < n
                mb = jax.tree_util.tree_map(lambda x: x[rows], batch)
                mb = mb.replace(loss_mask=mb.loss_mask & real[:, None], keep=None)
                return jax.lax.cond(c * mini < n, lambda: chunk(params, mb),
                                    lambda: {c_: (jnp.float32(0), jnp.float32(0))
                                             for c_ in vgs})

            per_chunk = jax.lax.map(run, jnp.arange(chunks))
            used = jnp.maximum(-(-n // mini), 1).astype(jnp.float32)
            std = jnp.where(inside, batch.group_std, 0.0)
            return {"grad": {c: per_chunk[c][0].sum() / used for c in vgs},
                    "loss": {c: per_chunk[c][1].sum() / used for c in vgs},
                    "rows": n, "tokens": (batch.loss_mask & inside[:, None]).sum(),
                    "total_rows": total_rows,
                    "std_mean": std.sum() / jnp.maximum(n, 1),
                    "std_min": jnp.where(inside, batch.group_std, jnp.inf).min(),
                    "std_max": jnp.where(inside, batch.group_std, -jnp.inf).max()}

        return jax.lax.map(one, jnp.arange(n_buckets + 1))

    return analyse


def scalars(result, components) -> dict:
    """RAGEN-2's metric names of an `analyse` result (host numbers); empty buckets left out."""
    r = jax.device_get(result)
    out = {}
    for k in range(len(r["rows"])):
        n = int(r["rows"][k])
        if n == 0:
            continue
        name = "all" if k == 0 else f"bucket_{k}"
        p = f"grad_norm/{name}"
        out[f"{p}/sample_count"] = float(n)
        out[f"{p}/sample_pct"] = n / max(int(r["total_rows"][k]), 1)
        out.update({f"{p}/reward_std_mean": float(r["std_mean"][k]),
                    f"{p}/reward_std_min": float(r["std_min"][k]),
                    f"{p}/reward_std_max": float(r["std_max"][k])})
        tokens = int(r["tokens"][k])
        for c in components:
            v = float(r["grad"][c][k])
            out[f"{p}/{c}"] = v
            out[f"{p}/per_sample/{c}"] = v / n
            if tokens:
                out[f"{p}/per_token/{c}"] = v / tokens
        terms = {"policy" if c == "task" else c: float(r["loss"][c][k]) for c in components}
        terms["total"] = sum(terms.values())
        out.update({f"{p}/loss/{c}": v for c, v in terms.items()})
        if k == 0:  # RAGEN-2 mirrors the whole batch's figures to the actor's names
            out.update({f"actor/grad_norm/{c}": out[f"{p}/{c}"] for c in components})
            out.update({f"actor/loss/{c}": v for c, v in terms.items()})
    return out


class GradientAnalysis:
    """The per-step analysis of a run: `due(n)` on RAGEN-2's steps (1, then every `every`-th
    after it: 1, 1 + every, ..), `__call__(state, traj, ref_params)` -> the scalars of that
    batch, prepared as the update prepares it, with the params that sampled it."""

    def __init__(self, algo, actor_cfg, critic_cfg=None, *, every: int, count: int = 6,
                 mode: str = "quantile", compiler_options=None):
        self.every, self.terms = every, components(algo)
        # compiled as the update's programs are (`trainer.fast_compile`)
        self.prepare = jax.jit(update_lib.make_prepare(algo, actor_cfg, critic_cfg),
                               compiler_options=compiler_options)
        self.analyse = make_analysis(algo, actor_cfg, count, mode, compiler_options)

    def due(self, n: int) -> bool:
        return self.every > 0 and (n - 1) % self.every == 0

    def __call__(self, state, traj, ref_params=None) -> dict:
        batch, _ = self.prepare(state, traj, ref_params)
        return scalars(self.analyse(state.actor_params, batch), self.terms)
