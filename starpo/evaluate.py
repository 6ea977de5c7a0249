"""Rollouts for measuring a policy: per-env-tag summaries, validation sets, evaluation tables.

`summarize` turns one rollout's Trajectory and per-episode metrics into the scalars a run logs
per env tag (the reference's `success`, `pass@k`, `num_actions`, `action_is_valid`,
`action_is_effective`, plus response length, score, turns, format errors, truncation, context);
`summarize_mix` does it per tag of a batch that mixes env variants.
`EvalSet` is a fixed set of held-out levels of one env variant (the validation stream, disjoint
from training), played by a jitted rollout at a given temperature; training validates on it
and `launch/eval.py` prints a table of it.
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp
import numpy as np

import envs
from starpo import rollout as rollout_lib
from starpo import sharding

# Summaries of per-episode arrays, in the order tables print them.
TABLE_COLUMNS = ("success", "score", "action_is_valid", "num_actions", "response_length")


def summarize(traj, metrics, group_size: int) -> dict[str, float]:
    """Host-side scalars of one rollout (`traj`, `metrics` may be device or numpy arrays).

    success / pass@k (k = group_size: a group passes if any of its episodes succeeded) /
    pass^k (k = group_size > 1 only: the share of groups whose every episode succeeded; so
    1 - pass@k of the groups all failed, and the rest, pass@k - pass^k, are the groups whose
    successes differ: where the reward is success alone, the only ones with a GRPO advantage) /
    success_stderr (the standard error of success over the groups: the std of the groups' mean
    successes over sqrt(groups); a group's episodes share a level, so they count once) /
    score (trajectory reward: turn rewards + format penalty) / num_actions / action_is_valid /
    action_is_effective / num_turns / format_errors / truncated / response_length /
    context_used / context_used_max, each a mean over episodes unless named otherwise.
    """
    t, m = sharding.to_host((traj, metrics))
    success = np.asarray(t.success, np.float64)
    groups = success.reshape(-1, group_size)
    score = np.asarray(t.turn_reward, np.float64).sum(1) + np.asarray(t.penalty, np.float64)
    out = {
        "success": success.mean(),
        f"pass@{group_size}": groups.max(axis=1).mean(),
        "score": score.mean(),
        "num_actions": np.mean(t.num_actions),
        "action_is_valid": np.mean(m["action_is_valid"]),
        "action_is_effective": np.mean(m["action_is_effective"]),
        "num_turns": np.mean(m["num_turns"]),
        "format_errors": np.mean(m["format_errors"]),
        "truncated": np.mean(m["truncated"]),
        "response_length": np.mean(m["response_length"]),
        "context_used": np.mean(m["context_used"]),
        "context_used_max": np.max(m["context_used"]),
        "generated_tokens": np.sum(m["response_length"]),
    }
    per_group = groups.mean(axis=1)
    out["success_stderr"] = (per_group.std(ddof=1) / np.sqrt(len(per_group))
                             if len(per_group) > 1 else 0.0)
    if group_size > 1:
        out[f"pass^{group_size}"] = groups.min(axis=1).mean()
    return {k: float(v) for k, v in out.items()}


def paired(success_a, success_b, group_size: int) -> dict[str, float]:
    """Two policies' successes on the same episodes (the same levels and sampling keys, rows in
    the set's order), compared level by level: each level's mean success under a minus under b;
    `success_diff` the mean of those differences (= a's success - b's), `success_diff_stderr`
    its standard error over the levels (their std / sqrt(levels)), `levels_better` /
    `levels_worse` the levels where a's mean success is above / below b's."""
    a, b = (np.asarray(s, np.float64).reshape(-1, group_size).mean(1)
            for s in sharding.to_host((success_a, success_b)))
    d = a - b
    return {"success_diff": float(d.mean()),
            "success_diff_stderr": float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0,
            "levels_better": int((d > 0).sum()), "levels_worse": int((d < 0).sum())}


def check_comparable(a, b) -> None:
    """Raise ValueError unless the loaded models `a` and `b` (weights.LoadedModel) are the same
    model with other weights: the same architecture (the training-only settings remat and the
    attention kernels aside: they give the same numbers) and the same tokenizer, so that b plays
    on the programs built for a."""
    same = dict(remat=a.cfg.remat, remat_policy=a.cfg.remat_policy, attention=a.cfg.attention,
                decode_attention=a.cfg.decode_attention)
    cb = b.cfg.replace(**same)
    if cb != a.cfg:
        diff = [f"{f.name} {getattr(a.cfg, f.name)!r} vs {getattr(cb, f.name)!r}"
                for f in dataclasses.fields(a.cfg) if getattr(a.cfg, f.name) != getattr(cb, f.name)]
        raise ValueError(f"{b.source} is another model than {a.source}: {', '.join(diff)}")
    ta, tb = a.tokenizer, b.tokenizer
    if (ta.hf.get_vocab(), ta.eos_ids, ta.pad_id) != (tb.hf.get_vocab(), tb.eos_ids, tb.pad_id):
        raise ValueError(f"{b.source} has another tokenizer than {a.source}")


def summarize_mix(traj, metrics, mix, group_size: int) -> dict[str, float]:
    """`summarize` per env variant of a batch whose rows are laid out env by env:
    mix = ((tag, groups), ...) -> scalars named `<tag>/<name>`."""
    t, m = sharding.to_host((traj, metrics))
    out, start = {}, 0
    for tag, groups in mix:
        rows = slice(start, start + groups * group_size)
        part = jax.tree_util.tree_map(operator.itemgetter(rows), (t, m))
        out.update({f"{tag}/{k}": v for k, v in summarize(*part, group_size).items()})
        start = rows.stop
    return out


def dialogue(tokenizer, traj, row: int = 0) -> str:
    """The decoded text of one episode, exactly as the model saw and wrote it."""
    n = int(jax.device_get(traj.length[row]))
    return tokenizer.decode(np.asarray(jax.device_get(traj.tokens[row, :n])).tolist())


def parse_tags(tags: str, default: str) -> tuple[str, ...]:
    """`"A,B"` -> ("A", "B") with every name checked against envs.NAMES; "" -> (default,);
    an empty name between commas ("A,", ",") is an error, not the default."""
    if not tags.strip():
        return (default,)
    names = tuple(t.strip() for t in tags.split(","))
    if not all(names):
        raise ValueError(f"env tags {tags!r} name an empty tag; known: {', '.join(envs.NAMES)}")
    for name in names:
        if name not in envs.NAMES:
            raise ValueError(f"unknown env tag {name!r}; known: {', '.join(envs.NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"env tags repeat: {tags!r}")
    return names


@dataclasses.dataclass
class EvalSet:
    """A fixed set of held-out levels of one env variant and the rollout that plays them.

    The levels come from the validation stream (disjoint from training's) with seeds
    0 .. env_groups-1, each played `group_size` times; the same levels every call, whatever
    the run's seed, so numbers from different runs and checkpoints compare. They are played
    `batch_size` episodes at a time (whole groups; 0 = all at once) by one program of that
    many rows (`run_from`), chunk i with the key `fold_in(key, i)`
    (`rollout.play_in_chunks`): the numbers depend on batch_size only through the sampling
    stream, and with one chunk they are those of playing the whole set at once.
    """

    tag: str
    env: object
    rollout: rollout_lib.Rollout  # of batch_size rows
    run_from: object  # jitted (params, key, env_state, group_id, temperature) of one chunk
    env_state: object  # [env_groups * group_size] the whole set
    group_id: jax.Array
    group_size: int
    batch_size: int = 0  # episodes played at once (0 = the whole set)

    def play(self, params, key, temperature):
        """(Trajectory, per-episode metrics) of the whole set, rows in the set's order."""
        play_from = rollout_lib.play_in_chunks(self.run_from, self.group_id.shape[0],
                                               self.batch_size, self.group_size)
        return play_from(params, key, self.env_state, self.group_id, jnp.float32(temperature))


def make_eval_set(tag: str, env, tokenizer, model_cfg, *, env_groups: int, group_size: int,
                  spec: rollout_lib.RolloutSpec, compiler_options=None, run_from=None,
                  rollout: rollout_lib.Rollout | None = None, batch_size: int = 0,
                  rows_sharding=None) -> EvalSet:
    """An EvalSet of `env_groups x group_size` episodes with the rollout settings `spec`,
    played `batch_size` at a time (whole groups dividing the set; 0 = all at once). Pass an
    existing `rollout` and `run_from` (its `play_from`, jitted) of the same env and of
    batch_size rows to share its compiled program, and `rows_sharding` (the set's rows split
    over a mesh, `sharding.batch_sharding`) to place the levels as that program's inputs were:
    a program compiled for inputs placed one way is compiled again for another."""
    chunk = rollout_lib.chunk_size(env_groups * group_size, batch_size, group_size)
    if rollout is None:
        rollout = rollout_lib.make_rollout(env, tokenizer, model_cfg, spec,
                                           env_groups=chunk // group_size, group_size=group_size)
    if run_from is None:
        run_from = jax.jit(rollout.play_from, compiler_options=compiler_options)
    out = None if rows_sharding is None else (rows_sharding, rows_sharding)
    states, group_id = jax.jit(rollout_lib.initial_states, static_argnums=(0, 3, 4, 5),
                               out_shardings=out)(
        env, jax.random.key(0), jnp.int32(0), rollout_lib.VALIDATION, env_groups, group_size)
    return EvalSet(tag, env, rollout, run_from, states, group_id, group_size, chunk)


def format_table(results: dict[str, dict[str, float]], columns=TABLE_COLUMNS) -> str:
    """A plain-text table: one row per env tag."""
    head = ["env"] + list(columns)
    rows = [[tag] + [f"{r.get(c, float('nan')):.3f}" for c in columns] for tag, r in results.items()]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])
