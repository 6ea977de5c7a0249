"""RAGEN-2's template-collapse diagnostic (starpo/collapse.py) against slow references: the
first reply's reasoning found by a token-by-token loop, each (reasoning, prompt) pair built
explicitly and run through the model one at a time, and the statistics by plain Python."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo import collapse
from starpo import model as M
from starpo.trajectory import Trajectory

CFG = M.ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=16, intermediate_size=64)
TEMPERATURE = 0.8
# token bytes of a made-up vocabulary: ids 0..49 one letter each, then the pieces of `</think>`
BYTES = [bytes([97 + i % 26]) for i in range(50)] + [b"</think>", b"x</th", b"ink>", b"<answer>",
                                                     b" ", b"</answer>"] + [b"?"] * 8
END, SPLIT_A, SPLIT_B = 50, 51, 52
FAST = {"xla_backend_optimization_level": 0}
# one unpadded sequence through the model (compiled once per length)
forward = jax.jit(lambda p, t: M.forward(p, CFG, t, jnp.ones(t.shape, bool))[0][0],
                  compiler_options=FAST)


def episodes(prompts, replies, group_size):
    """A Trajectory whose row b is prompts[b // group_size], then replies[b] (turn 0's model
    tokens), then a turn-1 observation and reply (which the diagnostic must ignore)."""
    B = len(replies)
    T = max(len(prompts[b // group_size]) + len(replies[b]) for b in range(B)) + 5
    tokens = np.zeros((B, T), np.int32)
    loss_mask = np.zeros((B, T), bool)
    turn_index = np.full((B, T), -1, np.int32)
    length = np.zeros(B, np.int32)
    for b, reply in enumerate(replies):
        p = prompts[b // group_size]
        row = list(p) + list(reply) + [7, 8, 9] + [10, 11]
        tokens[b, :len(row)] = row
        turn_index[b, :len(p) + len(reply)] = 0
        turn_index[b, len(p) + len(reply):len(row)] = 1
        loss_mask[b, len(p):len(p) + len(reply)] = True
        loss_mask[b, len(row) - 2:len(row)] = True
        length[b] = len(row)
    z = jnp.zeros((B, 2))
    return Trajectory(
        tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(loss_mask),
        turn_index=jnp.asarray(turn_index), sample_logprobs=jnp.zeros((B, T)),
        turn_end=jnp.zeros((B, 2), jnp.int32), turn_reward=z, penalty=jnp.zeros(B),
        success=jnp.zeros(B, bool), num_actions=jnp.zeros(B, jnp.int32),
        group_id=jnp.asarray(np.repeat(np.arange(B // group_size) * 3 + 1, group_size),
                             jnp.int32),
        tag=jnp.zeros(B, jnp.int32), length=jnp.asarray(length))


def reference_reasoning(reply, thinking):
    """The reasoning tokens of a reply, by walking it: everything (thinking off), or the tokens
    that end before the first `</think>` byte, none if it never closes."""
    if not thinking:
        return list(reply)
    text = b"".join(BYTES[t] for t in reply)
    at = text.find(b"</think>")
    if at < 0:
        return []
    out, used = [], 0
    for t in reply:
        used += len(BYTES[t])
        if used > at:
            break
        out.append(t)
    return out


def reference_cross(params, prompts, reasons):
    """mean and summed log-prob [n,N] of each reasoning after each distinct-column prompt,
    one unpadded forward per pair at TEMPERATURE."""
    n, N = len(reasons), len(prompts)
    mean, total = np.zeros((n, N)), np.zeros((n, N))
    for i, r in enumerate(reasons):
        for j, p in enumerate(prompts):
            ctx = np.array(list(p) + list(r), np.int32)[None]
            logits = np.asarray(forward(params, jnp.asarray(ctx)), np.float64) / TEMPERATURE
            logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
            s = sum(float(logp[len(p) + k - 1, tok]) for k, tok in enumerate(r))
            mean[i, j], total[i, j] = s / len(r), s
    return mean, total


def reference_stats(mean, total, own, prompts):
    """The RAGEN-2 statistics written out one reasoning at a time."""
    n, N = mean.shape
    same = [[list(a) == list(b) for b in prompts] for a in prompts]
    mi, mi_seq, hits, chance, matched_all, marg_all = 0.0, 0.0, 0, 0.0, [], []
    top_hits = {2: 0, 4: 0, 8: 0}
    matched_s_all, marg_s_all = [], []
    for i in range(n):
        marg = math.log(sum(math.exp(v) for v in mean[i])) - math.log(N)
        marg_s = math.log(sum(math.exp(v) for v in total[i])) - math.log(N)
        mi += (mean[i, own[i]] - marg) / n
        mi_seq += (total[i, own[i]] - marg_s) / n
        best = max(range(N), key=lambda j: mean[i, j])
        hits += same[best][own[i]]
        ranked = sorted(range(N), key=lambda j: -mean[i, j])
        for k in top_hits:
            top_hits[k] += any(same[j][own[i]] for j in ranked[:k])
        chance += sum(same[own[i]]) / N / n
        matched_all.append(mean[i, own[i]])
        marg_all.append(marg)
        matched_s_all.append(total[i, own[i]])
        marg_s_all.append(marg_s)
    out = {"collapse/mi_estimate": mi, "collapse/mi_seq_estimate": mi_seq,
           "collapse/mi_upper_bound": math.log(N),
           "collapse/retrieval_accuracy": hits / n, "collapse/retrieval_chance_level": chance,
           "collapse/matched_log_prob_mean": float(np.mean(matched_all)),
           "collapse/marginal_log_prob_mean": float(np.mean(marg_all)),
           "collapse/conditional_entropy_est": -float(np.mean(matched_all)),
           "collapse/conditional_entropy_seq_est": -float(np.mean(matched_s_all)),
           "collapse/reasoning_entropy_seq_est": -float(np.mean(marg_s_all)),
           "collapse/marginal_std": float(np.std(marg_all)),
           "collapse/marginal_std_seq": float(np.std(marg_s_all)),
           "collapse/mi_zscore_seq": mi_seq / (float(np.std(marg_s_all)) + 1e-3)}
    for k, h in top_hits.items():  # RAGEN-2: k at most 8 and N; chance k times the top-1's
        out[f"collapse/retrieval_accuracy@{k}"] = h / n
        out[f"collapse/retrieval_chance_level@{k}"] = min(1.0, chance * min(k, N))
    return out


def test_first_turn_reasoning_is_the_think_part_or_the_whole_reply():
    prompts = [[1, 2, 3], [4, 5]]
    replies = [[20, 21, END, 53, 30, 55],  # "uv</think><answer>E </answer>": 2 tokens
               [22, SPLIT_A, SPLIT_B, 53],  # `</think>` starts inside "x</th": 1 token
               [23, 24, 25],  # never closes: none
               [END, 53, 31]]  # empty think part: none
    traj = episodes(prompts, replies, 2)
    host = jax.device_get(traj)
    for thinking in (True, False):
        start, n = collapse.first_turn_spans(host.tokens, host.loss_mask, host.turn_index,
                                             host.length, thinking, BYTES)
        assert list(start) == [3, 3, 2, 2]
        assert list(n) == [len(reference_reasoning(r, thinking)) for r in replies]
    assert list(n) == [6, 4, 3, 3] and list(start) == [3, 3, 2, 2]


@pytest.mark.parametrize("thinking,samples", [(False, 64), (True, 64), (False, 3)])
def test_cross_scores_and_statistics_match_a_pair_by_pair_forward(thinking, samples):
    rng = np.random.default_rng(1)
    # 4 groups of 2; groups 0 and 3 drew the same level (identical prompts)
    prompts = [list(rng.integers(1, 50, int(L))) for L in (5, 3, 7)]
    prompts.append(list(prompts[0]))
    replies = []
    for b in range(8):
        think = list(rng.integers(1, 50, int(rng.integers(1, 4))))
        replies.append(think + ([END, 53, 30, 55] if b != 5 else [30]))  # row 5: no `</think>`
    traj = episodes(prompts, replies, 2)
    params = M.init_params(CFG, jax.random.key(0))
    det = collapse.TemplateCollapse(CFG, BYTES, freq=2, samples=samples, micro=5,
                                    thinking=thinking, temperature=TEMPERATURE,
                                    compiler_options=FAST)
    got = det(params, traj, seed=3, n=4)

    reasons = [reference_reasoning(r, thinking) for r in replies]
    usable = [b for b in range(8) if reasons[b]]
    assert got["collapse/first_turn_num_valid"] == len(usable) == (7 if thinking else 8)
    assert got["collapse/first_turn_valid_rate"] == pytest.approx(len(usable) / 8)
    mean, total = reference_cross(params, prompts, [reasons[b] for b in usable])
    own = [b // 2 for b in usable]
    if samples >= len(usable):
        subsets = [list(range(len(usable)))]
    else:  # a random subset of `samples` usable rows: it must be one of them
        subsets = [list(s) for s in itertools.combinations(range(len(usable)), samples)]
    assert got["collapse/num_samples"] == len(subsets[0])
    candidates = [reference_stats(mean[s], total[s], [own[i] for i in s], prompts)
                  for s in subsets]
    matches = [c for c in candidates
               if all(math.isclose(got[k], v, rel_tol=1e-4, abs_tol=1e-5) for k, v in c.items())]
    assert matches, (got, candidates[:2])
    # the duplicated level: a reasoning of group 0 scored best under group 3 still counts
    assert got["collapse/retrieval_chance_level"] == pytest.approx(candidates[0][
        "collapse/retrieval_chance_level"]) and got["collapse/retrieval_chance_level"] > 0.25


def test_schedule_warning_and_identical_prompts():
    det = collapse.TemplateCollapse(CFG, BYTES, freq=5, samples=4, micro=4, thinking=False,
                                    compiler_options=FAST)
    assert [n for n in range(1, 17) if det.due(n)] == [1, 5, 10, 15]  # RAGEN-2: 1, then every 5
    off = collapse.TemplateCollapse(CFG, BYTES, freq=0, samples=4, micro=4, thinking=False)
    assert not any(off.due(n) for n in range(1, 20))
    # every group the same prompt: columns identical, MI exactly 0, retrieval at chance 1, no
    # warning (no information to lose); different prompts with MI below the bar: a warning
    traj = episodes([[1, 2, 3]] * 3, [[5], [6, 7], [8], [9], [10], [11]], 2)
    params = M.init_params(CFG, jax.random.key(1))
    m = det(params, traj, seed=0, n=1)
    assert abs(m["collapse/mi_estimate"]) < 1e-6
    assert m["collapse/retrieval_chance_level"] == 1.0 == m["collapse/retrieval_accuracy"]
    assert not collapse.warns(m, 0.01)
    assert collapse.warns({"collapse/mi_estimate": 0.005,
                           "collapse/retrieval_chance_level": 0.25}, 0.01)
    assert not collapse.warns({"collapse/mi_estimate": 0.02,
                               "collapse/retrieval_chance_level": 0.25}, 0.01)


def test_ema_of_the_marginals_std_carries_across_steps_and_checkpoints():
    """RAGEN-2's `_ema` figures: the EMA of the marginals' std starts at its first value and
    moves by a tenth towards each later one (decay 0.9), per sample; the MI over it is the
    `mi_zscore_ema`. A diagnostic restored from `state_dict` (a resumed run) goes on from it."""
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(1, 50, int(L))) for L in (4, 6, 3)]
    replies = [list(rng.integers(1, 50, int(rng.integers(1, 4)))) for _ in range(6)]
    traj = episodes(prompts, replies, 2)
    kw = dict(freq=1, samples=16, micro=8, thinking=False, compiler_options=FAST,
              multi_turn=True)
    det = collapse.TemplateCollapse(CFG, BYTES, **kw)
    first = det(M.init_params(CFG, jax.random.key(3)), traj, seed=0, n=1)
    params = M.init_params(CFG, jax.random.key(4))
    saved = det.state_dict()
    second = det(params, traj, seed=0, n=2)
    for prefix in ("collapse/", "collapse_trajectory_sample/"):
        for std, mi, suffix in (("marginal_std", "mi_estimate", ""),
                                ("marginal_std_seq", "mi_seq_estimate", "_seq")):
            ema1 = first[f"{prefix}marginal_std_ema{suffix}"]
            assert ema1 == first[prefix + std]
            ema2 = 0.9 * ema1 + 0.1 * second[prefix + std]
            assert second[f"{prefix}marginal_std_ema{suffix}"] == pytest.approx(ema2, rel=1e-12)
            assert second[f"{prefix}mi_zscore_ema{suffix}"] == pytest.approx(
                second[prefix + mi] / (ema2 + 1e-3), rel=1e-12)
        assert first[prefix + "marginal_std"] != second[prefix + "marginal_std"]  # it moved
    resumed = collapse.TemplateCollapse(CFG, BYTES, **kw)
    resumed.load_state_dict(saved)
    assert resumed(params, traj, seed=0, n=2) == second


def test_trajectory_uniform_draws_weigh_every_trajectory_alike():
    """RAGEN-2's trajectory-uniform sample: a row uniformly, then one of its usable turns
    uniformly; a row without reasoning makes its draw come up empty; at most the usable turns'
    count of draws."""
    reason_len = np.array([[2, 3, 1, 4], [5, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]])
    rng = np.random.default_rng(0)
    draws = [p for _ in range(4000) for p in collapse.trajectory_uniform_pairs(reason_len, 8, rng)]
    rows = np.bincount([m for m, _ in draws], minlength=4) / 4000 / 7  # 7 usable turns
    np.testing.assert_allclose(rows, [0.25, 0.25, 0.0, 0.25], atol=0.01)
    turns0 = np.bincount([t for m, t in draws if m == 0], minlength=4)
    np.testing.assert_allclose(turns0 / turns0.sum(), 0.25, atol=0.02)
    assert all(reason_len[m, t] > 0 for m, t in draws)
    assert len(collapse.trajectory_uniform_pairs(reason_len, 100, rng)) <= 7


def test_trajectory_sample_scores_every_pair_against_every_pair_prompt():
    """The multi-turn sample's statistics against a pair-by-pair forward: each drawn (row,
    turn) is a column of its own whose prompt is everything before that turn's reply."""
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(1, 50, int(L))) for L in (4, 6, 3)]
    replies = [list(rng.integers(1, 50, int(rng.integers(1, 4)))) for _ in range(6)]
    traj = episodes(prompts, replies, 2)
    host = jax.device_get(traj)
    params = M.init_params(CFG, jax.random.key(2))
    det = collapse.TemplateCollapse(CFG, BYTES, freq=1, samples=16, micro=8, thinking=False,
                                    temperature=TEMPERATURE, compiler_options=FAST,
                                    multi_turn=True)
    got = det(params, traj, seed=5, n=1)
    # the same stream: 6 usable first-turn rows <= 16 samples, so nothing drawn before it
    spans = [collapse.turn_spans(host.tokens, host.loss_mask, host.turn_index, host.length,
                                 False, BYTES, k) for k in range(2)]
    reason_len = np.stack([r for _, r in spans], axis=1)
    pairs = collapse.trajectory_uniform_pairs(reason_len, 16, np.random.default_rng([5, 1]))
    assert got["collapse_trajectory_sample/num_samples"] == len(pairs) == 12
    assert got["collapse/valid_thinking_rate"] == 1.0
    start = [None, None]
    for k in range(2):  # each turn's reply start, by walking the rows
        start[k] = [int(np.flatnonzero(host.loss_mask[b] & (host.turn_index[b] == k))[0])
                    for b in range(6)]
    pair_prompts = [list(host.tokens[m, :start[t][m]]) for m, t in pairs]
    reasons = [list(replies[m]) if t == 0 else [10, 11] for m, t in pairs]
    mean, total = reference_cross(params, pair_prompts, reasons)
    want = reference_stats(mean, total, list(range(len(pairs))), pair_prompts)
    for k, v in want.items():
        name = "collapse_trajectory_sample/" + k.split("/", 1)[1]
        assert math.isclose(got[name], v, rel_tol=1e-4, abs_tol=1e-5), (name, got[name], v)


def test_no_diagnostic_under_a_context_window():
    """RAGEN-2 computes no collapse figures unless the whole dialogue is in context."""
    from configs import frozenlake
    from starpo import run_config, training

    c = frozenlake.get_config("tiny")
    c.trainer.collapse_mi_freq = 5
    c.rollout.context_window_mode, c.rollout.max_context_window = "limited", 2
    assert training.template_collapse(run_config.read(c), None) is None
