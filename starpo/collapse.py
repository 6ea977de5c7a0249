"""RAGEN-2's template-collapse diagnostic (RAGEN `ragen/trainer/collapse_metrics.py`,
`CollapseDetector`: its first-turn and its multi-turn trajectory-uniform samples), wired into
training by `trainer.collapse_mi_freq` (and `trainer.collapse_mi_multi_turn`). As RAGEN-2 it
runs only with the whole dialogue in context (`rollout.context_window_mode=full`): under a
window, rows of one group no longer share their prompts.

Template collapse: the model's reasoning stops depending on its input, I(X;R) falls, while its
entropy may stay high (so the Echo Trap warning, which watches entropy, misses it). RAGEN-2
estimates I(X;R) under the batch's empirical prompt distribution (uniform over its N prompts):
every sampled reasoning r_i is scored under every prompt x_j by teacher forcing with the
current policy, l_j(r_i) = mean log-prob per reasoning token of r_i after x_j, and

    matched_i  = l_{g(i)}(r_i)                        (its own prompt g(i))
    marginal_i = logsumexp_j l_j(r_i) - log N         (the uniform mixture of prompts)
    collapse/mi_estimate = mean_i (matched_i - marginal_i)     (at most log N)
    collapse/retrieval_accuracy = share of i whose best-scoring prompt is its own (chance ~1/N)

and, as RAGEN-2, the same over summed log-probs (`_seq`), retrieval among the k best prompts
(`@2`, `@4`, `@8`), the MI over the marginals' std (`mi_zscore`) and over that std's EMA across
diagnostic steps (`_ema`, decay 0.9).

What is scored, as RAGEN-2's first-turn sample: the prompt x is everything before the first
reply's first model token (system prompt, env prefix, turn 1's observation and the reply prime),
identical in every row of a group; the reasoning r is the first reply's `<think>` content, i.e.
its model tokens before the token where `</think>` begins. A reply without `</think>` or with
an empty think part has no reasoning and is left out (RAGEN-2's regex finds none), and
`collapse/first_turn_valid_rate` says how many were usable. Deliberate differences:
- the scored tokens are the sampled ones (RAGEN-2 re-tokenises the stripped think text);
- the columns are all of the batch's groups (RAGEN-2: the groups among the sampled rows);
- thinking off (`rollout.enable_think=False`, the tiny configs): RAGEN-2 turns the detector
  off; here the reasoning is the whole first reply (its model tokens, e.g. `Left</answer>`),
  so the diagnostic says whether the first answer depends on the level at all;
- the EMA of the marginals' std (`_ema` figures) is kept in the run's checkpoints, so a
  resumed run goes on from it (RAGEN-2 keeps it in memory: a restart begins it again);
- the first-turn figures are named collapse/<name> (RAGEN-2: collapse_first_turn_sample/).

The multi-turn sample (`trajectory_sample`): RAGEN-2's trajectory-uniform draws of (episode,
turn) pairs, each pair a column of its own whose prompt is the whole dialogue before that
turn's reply; logged as collapse_trajectory_sample/<name>, as RAGEN-2 names them. Its cost is
up to collapse_mi_samples^2 sequences of dialogue length per diagnostic step.
RAGEN-2 has no threshold; `trainer.collapse_mi_warn` adds a warning line like the Echo Trap's.

Cost: N forward passes of the sampled reasoning (n x N sequences of prompt + reasoning, at most
`collapse_mi_samples` rows), on the steps RAGEN-2 computes it (the first, then every
`collapse_mi_freq`-th); nothing at all when the knob is 0 (the default).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from starpo import sharding
from starpo import update as update_lib

THINK_END = b"</think>"
BUCKET = 64  # pair sequences are padded to a multiple of this (few distinct compiled shapes)
STD_EPS = 1e-3  # RAGEN-2's std_eps: the z-scores' denominators are std + this
EMA_DECAY = 0.9  # RAGEN-2's ema_decay of the marginals' std across diagnostic steps


def mi_metrics(cross_logp, own, cross_sum=None, same=None) -> dict:
    """RAGEN-2's collapse/ statistics (host, numpy) from cross scores f32[n,N] (row i: reasoning
    i's mean per-token log-prob under each of the N prompts) and own int[n] (its prompt's column).

    cross_sum f32[n,N]: the summed (per-sequence) log-probs, for the `_seq` figures. same
    bool[N,N]: columns whose prompts are identical token for token (two groups can draw the same
    level); a reasoning retrieved by an identical prompt counts as retrieved, and the chance
    level is the share of columns identical to its own (RAGEN-2's prompt signatures)."""
    cross = np.asarray(cross_logp, np.float64)
    own = np.asarray(own)
    n, N = cross.shape
    same = np.eye(N, dtype=bool) if same is None else np.asarray(same, bool)
    rows = np.arange(n)

    def stats(x):
        m = x.max(axis=1, keepdims=True)
        marginal = m[:, 0] + np.log(np.exp(x - m).sum(axis=1)) - math.log(N)
        return x[rows, own], marginal

    matched, marginal = stats(cross)
    hit = same[np.argmax(cross, axis=1), own]
    chance = float((same[own].sum(axis=1) / N).mean())
    std = float(marginal.std())
    out = {"collapse/mi_estimate": float((matched - marginal).mean()),
           "collapse/mi_upper_bound": math.log(N),
           "collapse/matched_log_prob_mean": float(matched.mean()),
           "collapse/marginal_log_prob_mean": float(marginal.mean()),
           "collapse/retrieval_accuracy": float(hit.mean()),
           "collapse/retrieval_chance_level": chance,
           "collapse/retrieval_above_chance": float(hit.mean()) - chance,
           "collapse/conditional_entropy_est": -float(matched.mean()),
           "collapse/reasoning_entropy_est": -float(marginal.mean()),
           "collapse/marginal_std": std,
           "collapse/mi_zscore": float(((matched - marginal) / (std + STD_EPS)).mean())}
    # top-k retrieval: its own prompt (or an identical one) among the k best-scoring columns
    best = np.argsort(-cross, axis=1, kind="stable")[:, :min(8, N)]
    for k in (2, 4, 8):
        k_eff = min(k, best.shape[1])
        accuracy = float(same[best[:, :k_eff], own[:, None]].any(axis=1).mean())
        chance_k = min(1.0, chance * k_eff)
        out.update({f"collapse/retrieval_accuracy@{k}": accuracy,
                    f"collapse/retrieval_chance_level@{k}": chance_k,
                    f"collapse/retrieval_above_chance@{k}": accuracy - chance_k})
    if cross_sum is not None:
        matched_s, marginal_s = stats(np.asarray(cross_sum, np.float64))
        std_s = float(marginal_s.std())
        out.update({"collapse/mi_seq_estimate": float((matched_s - marginal_s).mean()),
                    "collapse/conditional_entropy_seq_est": -float(matched_s.mean()),
                    "collapse/reasoning_entropy_seq_est": -float(marginal_s.mean()),
                    "collapse/marginal_std_seq": std_s,
                    "collapse/mi_zscore_seq": float(((matched_s - marginal_s)
                                                     / (std_s + STD_EPS)).mean())})
    return out


def with_ema(metrics: dict, previous: dict | None, decay: float = EMA_DECAY) -> tuple:
    """RAGEN-2's cross-time normalisation of one sample's statistics (`mi_metrics` of this
    step; `previous`: the state this returned at that sample's last diagnostic step, None at
    its first). The EMA of the marginals' std (and of the summed log-probs' std) starts at its
    first value and moves by (1 - decay) each diagnostic step; the MI over it is the z-score a
    run's steps can be compared by. Returns (metrics with the _ema figures, the new state)."""
    state = {}
    for name, suffix in (("collapse/marginal_std", ""), ("collapse/marginal_std_seq", "_seq")):
        if name not in metrics:
            continue
        now = metrics[name]
        before = (previous or {}).get(name)
        ema = now if before is None else decay * before + (1 - decay) * now
        state[name] = ema
        mi = metrics["collapse/mi_estimate" if not suffix else "collapse/mi_seq_estimate"]
        metrics = {**metrics, f"collapse/marginal_std_ema{suffix}": ema,
                   f"collapse/mi_zscore_ema{suffix}": mi / (ema + STD_EPS)}
    return metrics, state


def warns(metrics: dict, threshold: float) -> bool:
    """Whether a step's collapse/ scalars call for the template-collapse warning: the MI
    estimate below `threshold`, where the batch's prompts differ at all (identical prompts, as
    every Bandit level's, carry no information: the MI is 0 by construction, not a collapse)."""
    return (metrics["collapse/mi_estimate"] < threshold
            and metrics["collapse/retrieval_chance_level"] < 1.0)


def turn_spans(tokens, loss_mask, turn_index, length, thinking: bool, token_bytes, turn=0):
    """(prompt_len int[B], reason_len int[B]) of each row's reply in turn `turn` (host numpy):
    the reply starts at prompt_len (its first model token; -1: the row has no such reply), its
    reasoning is the reason_len tokens from there (0: no usable reasoning). `token_bytes`: the
    tokenizer's bytes of each token id."""
    B, T = tokens.shape
    prompt_len = np.full(B, -1, np.int64)
    reason_len = np.zeros(B, np.int64)
    valid = np.arange(T)[None, :] < np.asarray(length)[:, None]
    first = np.asarray(loss_mask) & (np.asarray(turn_index) == turn) & valid
    for b in range(B):
        pos = np.flatnonzero(first[b])
        if pos.size == 0:
            continue
        prompt_len[b] = pos[0]
        reply = pos[:np.argmax(np.diff(pos) != 1) + 1] if (np.diff(pos) != 1).any() else pos
        if not thinking:
            reason_len[b] = reply.size
            continue
        text = b"".join(token_bytes[int(t)] for t in tokens[b, reply])
        end = text.find(THINK_END)
        if end < 0:
            continue
        ends = np.cumsum([len(token_bytes[int(t)]) for t in tokens[b, reply]])
        reason_len[b] = int((ends <= end).sum())  # tokens wholly before `</think>`
    return prompt_len, reason_len


def first_turn_spans(tokens, loss_mask, turn_index, length, thinking: bool, token_bytes):
    """`turn_spans` of the first reply: RAGEN-2's first-turn sample."""
    return turn_spans(tokens, loss_mask, turn_index, length, thinking, token_bytes, 0)


def pair_arrays(prompts, reasons, bucket: int = BUCKET):
    """The teacher-forcing inputs of every reasoning after every prompt (lists of token
    arrays). Returns (pair_tokens int32[n*N, L], pair_valid bool, score_mask bool (the reasoning
    tokens), same bool[N,N] (prompts identical token for token)); pair i*N + j is reasoning i
    after prompt j; L: the longest pair rounded up to `bucket`."""
    N, n = len(prompts), len(reasons)
    longest = max(len(p) for p in prompts) + max(len(x) for x in reasons)
    L = -(-longest // bucket) * bucket
    pair_tokens = np.zeros((n * N, L), np.int32)
    pair_valid = np.zeros((n * N, L), bool)
    score = np.zeros((n * N, L), bool)
    for i, r in enumerate(reasons):
        for j, p in enumerate(prompts):
            k, P, R = i * N + j, len(p), len(r)
            pair_tokens[k, :P], pair_tokens[k, P:P + R] = p, r
            pair_valid[k, :P + R] = True
            score[k, P:P + R] = True
    same = np.array([[len(a) == len(b) and bool((a == b).all()) for b in prompts]
                     for a in prompts])
    return pair_tokens, pair_valid, score, same


def group_columns(tokens, group_id, prompt_len, reason_len, rows):
    """The first-turn sample's (prompts, reasons, own int[n]): one column per group in order of
    first appearance (its prompt from the group's first row that has one), the reasoning of
    rows `rows` (int[n], rows with reasoning) and each one's group column."""
    group_id = np.asarray(group_id)
    columns, prompts = [], []
    for b in range(len(group_id)):
        if prompt_len[b] >= 0 and group_id[b] not in columns:
            columns.append(group_id[b])
            prompts.append(np.asarray(tokens[b, :prompt_len[b]]))
    reasons = [np.asarray(tokens[r, prompt_len[r]:prompt_len[r] + reason_len[r]]) for r in rows]
    return prompts, reasons, np.array([columns.index(group_id[r]) for r in rows])


def trajectory_uniform_pairs(reason_len, samples: int, rng) -> list[tuple[int, int]]:
    """RAGEN-2's trajectory-uniform sample of (row, turn) pairs, reason_len int[B,M] (0: the
    turn has no usable reasoning): min(samples, usable turns) draws, each a row uniformly, then
    one of its usable turns uniformly (a row without any makes its draw come up empty), so
    every trajectory weighs the same whatever its length. Rows may repeat."""
    usable = [np.flatnonzero(row > 0) for row in np.asarray(reason_len)]
    total = sum(len(u) for u in usable)
    pairs = []
    for _ in range(min(samples, total)):
        m = int(rng.integers(len(usable)))
        if len(usable[m]):
            pairs.append((m, int(usable[m][rng.integers(len(usable[m]))])))
    return pairs


def make_scorer(cfg, micro: int, chunk: int = 0, temperature: float = 1.0,
                compiler_options=None):
    """jitted (params, tokens int32[P,L], valid, score_mask) -> (sum f32[P], count f32[P]): each
    sequence's summed log-prob of its score_mask tokens under the policy at `temperature` (the
    training forward's `token_logprobs`), `micro` sequences at a time (P a multiple of it)."""
    def one(params, tokens, valid, mask):
        logp, _ = update_lib.token_logprobs(params, cfg, tokens, valid, chunk, temperature)
        return jnp.where(mask, logp, 0.0).sum(axis=1), mask.sum(axis=1).astype(jnp.float32)

    def score(params, tokens, valid, mask):
        split = lambda x: x.reshape((-1, micro) + x.shape[1:])
        s, c = jax.lax.map(lambda xs: one(params, *xs), (split(tokens), split(valid),
                                                           split(mask)))
        return s.reshape(-1), c.reshape(-1)
    return jax.jit(score, compiler_options=compiler_options)


class TemplateCollapse:
    """The per-step diagnostic of a run: `due(n)` on RAGEN-2's steps (the first, then every
    `freq`-th), `__call__(params, traj, seed, n)` -> the collapse/ scalars of that batch (before
    the update, with the params that sampled it)."""

    def __init__(self, cfg, token_bytes, *, freq: int, samples: int, micro: int,
                 thinking: bool, chunk: int = 0, temperature: float = 1.0,
                 compiler_options=None, multi_turn: bool = False):
        self.freq, self.samples, self.micro, self.thinking = freq, samples, micro, thinking
        self.multi_turn = multi_turn
        self.token_bytes = token_bytes
        self.score = make_scorer(cfg, micro, chunk, temperature, compiler_options)
        self.ema = {}  # per sample ("first_turn", "trajectory"): `with_ema`'s state

    def state_dict(self) -> dict:
        """The EMA state a checkpoint keeps, so that a resumed run logs what a straight one
        does (RAGEN-2 keeps it in memory: a restart begins it again)."""
        return {k: dict(v) for k, v in self.ema.items()}

    def load_state_dict(self, state: dict | None) -> None:
        self.ema = {k: dict(v) for k, v in (state or {}).items()}

    def due(self, n: int) -> bool:
        return self.freq > 0 and (n == 1 or n % self.freq == 0)

    def cross_scores(self, params, prompts, reasons, capacity):
        """(mean f32[n,N], sum f32[n,N], same bool[N,N]) of every reasoning after every prompt.
        The forward always runs `capacity` sequences (whole micro-batches) or more, however
        many pairs there are: the padding sequences score nothing, and the shape stays static."""
        pt, pv, pm, same = pair_arrays(prompts, reasons)
        P = pt.shape[0]
        pad = max(capacity - P, 0)
        pad += -(P + pad) % self.micro
        pt, pv, pm = (np.pad(x, ((0, pad), (0, 0))) for x in (pt, pv, pm))
        pv[P:, 0] = True  # a padding sequence attends to one token (no empty softmax)
        s, c = sharding.to_host(self.score(params, pt, pv, pm))
        n, N = len(reasons), len(prompts)
        s = s[:P].reshape(n, N)
        return s / np.maximum(c[:P].reshape(n, N), 1), s, same

    def __call__(self, params, traj, seed: int, n: int) -> dict:
        host = sharding.to_host({"tokens": traj.tokens, "loss_mask": traj.loss_mask,
                                 "turn_index": traj.turn_index, "length": traj.length,
                                 "group_id": traj.group_id})
        prompt_len, reason_len = first_turn_spans(host["tokens"], host["loss_mask"],
                                                  host["turn_index"], host["length"],
                                                  self.thinking, self.token_bytes)
        usable = np.flatnonzero(reason_len > 0)
        B = len(reason_len)
        out = {"collapse/first_turn_num_total": float(B),
               "collapse/first_turn_num_valid": float(usable.size),
               "collapse/first_turn_valid_rate": usable.size / B}
        columns = len(set(host["group_id"][prompt_len >= 0].tolist()))
        rng = np.random.default_rng([seed, n])  # a fixed stream per (seed, step): resumes repeat
        if usable.size and columns >= 2:  # RAGEN-2: fewer than 2 prompts say nothing
            rows = usable
            if usable.size > self.samples:
                rows = np.sort(rng.choice(usable, self.samples, replace=False))
            prompts, reasons, own = group_columns(host["tokens"], host["group_id"], prompt_len,
                                                  reason_len, rows)
            mean, total, same = self.cross_scores(params, prompts, reasons,
                                                  min(self.samples, B) * columns)
            stats, self.ema["first_turn"] = with_ema(mi_metrics(mean, own, total, same),
                                                     self.ema.get("first_turn"))
            out.update(stats)
            out["collapse/num_samples"] = float(len(rows))
        if self.multi_turn:
            out.update(self.trajectory_sample(params, host, rng))
        return out

    def trajectory_sample(self, params, host, rng) -> dict:
        """RAGEN-2's multi-turn diagnostic: `trajectory_uniform_pairs` of the batch's turns,
        each pair its own column (its prompt: the whole dialogue before that turn's reply), every
        reasoning scored after every pair's prompt; logged as collapse_trajectory_sample/<name>,
        with collapse/valid_thinking_rate (usable turns / turns played)."""
        M = int(host["turn_index"].max()) + 1
        spans = [turn_spans(host["tokens"], host["loss_mask"], host["turn_index"],
                            host["length"], self.thinking, self.token_bytes, k)
                 for k in range(M)]
        prompt_len = np.stack([p for p, _ in spans], axis=1)  # [B, M]
        reason_len = np.stack([r for _, r in spans], axis=1)
        played = int((prompt_len >= 0).sum())
        out = {"collapse/valid_thinking_rate": float((reason_len > 0).sum()) / max(played, 1)}
        pairs = trajectory_uniform_pairs(reason_len, self.samples, rng)
        if len(pairs) < 2:  # RAGEN-2: fewer than 2 prompts say nothing
            return out
        tokens = host["tokens"]
        prompts = [np.asarray(tokens[m, :prompt_len[m, t]]) for m, t in pairs]
        reasons = [np.asarray(tokens[m, prompt_len[m, t]:prompt_len[m, t] + reason_len[m, t]])
                   for m, t in pairs]
        mean, total, same = self.cross_scores(params, prompts, reasons, self.samples ** 2)
        stats, self.ema["trajectory"] = with_ema(mi_metrics(mean, np.arange(len(pairs)), total,
                                                            same), self.ema.get("trajectory"))
        out.update({"collapse_trajectory_sample/" + k.split("/", 1)[1]: v
                    for k, v in stats.items()})
        out["collapse_trajectory_sample/num_samples"] = float(len(pairs))
        return out
