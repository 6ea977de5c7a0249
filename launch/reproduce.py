"""Reproduce one of the paper's tables through the real entry points; print it beside the paper's.

  python launch/reproduce.py --table=main --model_path=/models/Qwen2.5-0.5B-Instruct --dry_run
  python launch/reproduce.py --table=main --model_path=/models/Qwen2.5-0.5B-Instruct
  python launch/reproduce.py --table=main --model_path=/models/Qwen2.5-0.5B-Instruct --print_only
  python launch/reproduce.py --table=main --variant=tiny --steps=2     # a smoke run on a CPU

--table: main (StarPO vs StarPO-S vs SFT on Bandit / FrozenLake / Sokoban), generalisation (the
paper's Table 4), actions_per_turn (Table 3), responses_per_prompt (Table 2), baselines (what
a trained model is read against: the solver's and the best constant move's exact success on
both lakes, the untrained model, SFT alone, SFT then RL, and the last two's difference on the
same levels and keys), or all. Each row is
a run of `launch/train.py` (or `launch/sft.py` for SFT) with config overrides, in
--workdir/<run>, then `launch/eval.py --out=...` on the held-out levels of every env variant the
table reads from it (the config's validation set: 256 levels at temperature 0.5 as in the paper,
unless --eval_groups). Runs are subprocesses, one after another; a finished run (its checkpoint
at the last step) or evaluation (its JSON in <run>/eval/) is skipped, so the same command resumes
an interrupted reproduction, and runs shared between tables (StarPO-S on Sokoban serves three)
are trained once. --dry_run prints the commands (those already done commented out) and runs
nothing; --print_only prints the table from the evaluations there are. The table gives our
success (%) beside the paper's, then one JSON line. --seeds=0,1,2 runs every row once per config
seed (the mean over seeds, with its standard error, in each cell); --parallel=3 runs the seeds
side by side (one GPU holds several small runs), each seed's commands in order, their output in
--workdir/logs/; or one command per seed, then --print_only --seeds=0,1,2 prints the table.

The rows, as config overrides of configs/<env>.py[:--variant] (the paper-sized config is
StarPO-S: PPO with a critic, the std filter keeping a quarter of the groups, decoupled clipping):
- StarPO-S: algorithm.adv_estimator=gae, rollout_filter_ratio=0.25, clip_ratio_low/high 0.2/0.28
- StarPO: the same without StarPO-S's additions: GRPO (no critic), no filter (ratio 1.0),
  symmetric clipping 0.2/0.2, and a KL loss to the initial policy (0.001, k3), which StarPO-S
  drops.
- SFT: launch/sft.py on solver demonstrations, as many steps as the RL rows train (under a
  variant whose RL runs warm-start with SFT, cpu and gpu: the warm start's steps, so that SFT is
  the starting point of SFT then RL).
Every run of an env validates on the variants its tables read (Sokoban: SimpleSokoban,
SokobanDifferentGridVocab, LargerSokoban, FrozenLake), which a tiny model's tokenizer needs too.
The paper's sizes (Qwen2.5-0.5B, 8 x 16 episodes of 5 turns, 200 steps) need an accelerator;
--variant=cpu / gpu / tiny run the same rows at those configs' sizes (cpu and gpu warm-start
their RL runs with SFT, as those configs do: the RL rows are then "SFT then RL").
"""

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time

if not __package__:  # run as a file from a checkout: launch/_checkout.py puts its root first
    import _checkout  # noqa: F401

from absl import flags  # noqa: E402

from launch import common  # noqa: E402

TABLE_NAMES = ("main", "generalisation", "actions_per_turn", "responses_per_prompt",
               "baselines")
flags.DEFINE_enum("table", None, (*TABLE_NAMES, "all"), "The paper's table to reproduce.")
flags.DEFINE_string("model_path", "", "Model of every run: a Hugging Face directory, .gguf "
                    "file, embedded name, tiny:... or random:... spec (default: the config's).")
flags.DEFINE_enum("variant", "", ("", "cpu", "gpu", "tiny"), "Config variant of every run "
                  "(default: the paper-sized configs).")
flags.DEFINE_string("workdir", "runs/repro", "Where the runs live, one folder each.")
flags.DEFINE_bool("dry_run", False, "Print the commands, run nothing.")
flags.DEFINE_bool("print_only", False, "Print the table from the finished evaluations.")
flags.DEFINE_integer("steps", 0, "Training steps of every run (RL and SFT; 0 = the config's "
                     "trainer.total_steps): short smoke runs.", lower_bound=0)
flags.DEFINE_integer("eval_groups", 0, "Held-out levels per env variant (0 = the config's "
                     "val.env_groups: 256 at the paper's size).", lower_bound=0)
flags.DEFINE_list("rows", [], "Only these rows (labels as printed; default all).")
flags.DEFINE_list("columns", [], "Only these columns (labels as printed; default all).")
flags.DEFINE_list("seeds", ["0"], "Config seeds: every run once per seed (seed 0's folder has "
                  "no suffix, seed k's ends in _seedk); a cell is the mean over the seeds with "
                  "an evaluation, with its standard error across them. --parallel runs them "
                  "side by side; so do separate commands with different --seeds, after which "
                  "--print_only with all the seeds prints the table.")
flags.DEFINE_integer("parallel", 1, "Seeds trained and evaluated side by side: each seed's "
                     "commands run in order, up to this many seeds at once, each process with "
                     "its share of an accelerator's memory (XLA_PYTHON_CLIENT_MEM_FRACTION = "
                     "0.9 / parallel unless set) and its output in --workdir/logs/.",
                     lower_bound=1)
flags.DEFINE_multi_string("set", [], "KEY=VALUE config override for every training run, e.g. "
                          "--set=model.dtype=bfloat16 (repeatable).")
FLAGS = flags.FLAGS

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG_FILE = {"Bandit": "bandit.py", "FrozenLake": "frozenlake.py", "SimpleSokoban": "sokoban.py",
               "FrozenLakeNonSlippery": "frozenlake.py"}
# Envs trained from another env's config file: its overrides (RAGEN-2's default lake, 4x4 and
# not slippery, under its own name, so that the paper's slippery lake stays "FrozenLake").
ENV_OVERRIDES = {"FrozenLakeNonSlippery": {"env.name": "FrozenLakeNonSlippery",
                                           "env.options.is_slippery": False}}
# What each env's runs validate on, and what the tables evaluate them on.
VAL_TAGS = {"Bandit": "Bandit,BanditTest", "FrozenLake": "FrozenLake,FrozenLakeNonSlippery",
            "FrozenLakeNonSlippery": "FrozenLakeNonSlippery,FrozenLake",
            "SimpleSokoban": "SimpleSokoban,SokobanDifferentGridVocab,LargerSokoban,FrozenLake"}
# Every lake run is also evaluated on the other lake (issue 38: reading the map shows on the
# non-slippery one), whichever table asks for it.
ALSO_EVALUATED = {"FrozenLake": ("FrozenLakeNonSlippery",),
                  "FrozenLakeNonSlippery": ("FrozenLake",)}
# The paper's names of our env variants, where they differ.
PAPER_NAME = {"SimpleSokoban": "Sokoban", "SokobanDifferentGridVocab": "NewVocab",
              "LargerSokoban": "LargeSokoban", "BanditTest": "Bandit-Rev"}
ALGORITHMS = {
    "StarPO-S": {"adv_estimator": "gae", "rollout_filter_ratio": 0.25, "clip_ratio_low": 0.2,
                 "clip_ratio_high": 0.28},
    # StarPO-S's third change is "decoupled clipping and no KL term": vanilla StarPO keeps a KL
    # loss to the initial policy (verl's default coefficient 0.001, k3 estimator)
    "StarPO": {"adv_estimator": "grpo", "rollout_filter_ratio": 1.0, "clip_ratio_low": 0.2,
               "clip_ratio_high": 0.2, "use_kl_loss": True, "kl_loss_coef": 0.001,
               "kl_loss_type": "low_var_kl"},
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: `algo` (StarPO, StarPO-S or SFT; "untrained": no training, the
    config's initial model evaluated) on `env` with a variation."""
    algo: str
    env: str
    think: bool = True  # False: rollout.enable_think=False
    actions: int = 0  # rollout.max_actions_per_turn (0 = the env's budget)
    responses: int = 0  # rollout.group_size with the same episodes per batch (0 = the config's)
    seed: int = 0  # the config's seed (sampling, mini-batch order, training levels)

    @property
    def name(self) -> str:
        return (f"{self.algo.lower()}_{self.env}" + ("" if self.think else "_nothink")
                + (f"_actions{self.actions}" if self.actions else "")
                + (f"_responses{self.responses}" if self.responses else "")
                + (f"_seed{self.seed}" if self.seed else ""))


@dataclasses.dataclass(frozen=True)
class Cell:
    run: Run | None  # None: an exact figure, no run
    tag: str  # the env variant evaluated
    paper: float | None  # the paper's success (%), None where it gives none
    approx: bool = False  # read off a figure
    exact: str = ""  # a policy of experiments/lake_baselines.py: its exact expected success
    paired: bool = False  # run's success minus its SFT warm start's, on the same levels and keys


# The paper's numbers (RAGEN v1: Qwen2.5-0.5B-Instruct, 8 prompts x 16 trajectories, 200 steps,
# success % on 256 held-out prompts at temperature 0.5; as docs/reference.md section 6 lists them).
def _tables():
    def s(env, **kw):
        return Run("StarPO-S", env, **kw)

    sokoban_gen = ("Sokoban", "SimpleSokoban"), ("NewVocab", "SokobanDifferentGridVocab"), (
        "LargeSokoban", "LargerSokoban"), ("FrozenLake", "FrozenLake")
    bandit_gen = ("Bandit", "Bandit"), ("Bandit-Rev", "BanditTest")
    return {
        # Section 4's main comparison: StarPO-S 20.3 (Sokoban) / 21.8 (FrozenLake); SFT 74.6 /
        # 23; vanilla StarPO peaks near 0.1 / 0.2 before it collapses (read off its figures);
        # StarPO-S on Bandit: Table 4's 100.
        "main": ("Main result: StarPO vs StarPO-S vs SFT, trained and evaluated on each env",
                 ("Bandit", "FrozenLake", "Sokoban"), {
                     "StarPO": {"Bandit": Cell(Run("StarPO", "Bandit"), "Bandit", None),
                                "FrozenLake": Cell(Run("StarPO", "FrozenLake"), "FrozenLake",
                                                   20.0, approx=True),
                                "Sokoban": Cell(Run("StarPO", "SimpleSokoban"), "SimpleSokoban",
                                                10.0, approx=True)},
                     "StarPO-S": {"Bandit": Cell(s("Bandit"), "Bandit", 100.0),
                                  "FrozenLake": Cell(s("FrozenLake"), "FrozenLake", 21.8),
                                  "Sokoban": Cell(s("SimpleSokoban"), "SimpleSokoban", 20.3)},
                     "SFT": {"Bandit": Cell(Run("SFT", "Bandit"), "Bandit", None),
                             "FrozenLake": Cell(Run("SFT", "FrozenLake"), "FrozenLake", 23.0),
                             "Sokoban": Cell(Run("SFT", "SimpleSokoban"), "SimpleSokoban",
                                             74.6)}}),
        # Table 4: trained on Sokoban 21.48 / 18.75 / 2.34 / 19.92 (no thinking 20.73 / 26.17 /
        # 2.73 / 19.53); trained on Bandit 100 / 67.58 (no thinking 81.25 / 56.25).
        "generalisation": ("Table 4: generalisation, StarPO-S trained on one env, evaluated on "
                           + "its variants", tuple(c for c, _ in sokoban_gen + bandit_gen), {
            "Sokoban": {c: Cell(s("SimpleSokoban"), t, p) for (c, t), p in
                        zip(sokoban_gen, (21.48, 18.75, 2.34, 19.92))},
            "Sokoban, no thinking": {c: Cell(s("SimpleSokoban", think=False), t, p) for (c, t), p
                                     in zip(sokoban_gen, (20.73, 26.17, 2.73, 19.53))},
            "Bandit": {c: Cell(s("Bandit"), t, p) for (c, t), p in zip(bandit_gen, (100.0, 67.58))},
            "Bandit, no thinking": {c: Cell(s("Bandit", think=False), t, p) for (c, t), p in
                                    zip(bandit_gen, (81.25, 56.25))}}),
        # Table 3: 5 actions per turn: Sokoban 28.13, FrozenLake 21.09; 6: Sokoban 33.59. Five is
        # the envs' own budget: that row is the main StarPO-S runs.
        "actions_per_turn": ("Table 3: StarPO-S with N actions per turn (10 per episode)",
                             ("Sokoban", "FrozenLake"), {
            "5 actions": {"Sokoban": Cell(s("SimpleSokoban"), "SimpleSokoban", 28.13),
                          "FrozenLake": Cell(s("FrozenLake"), "FrozenLake", 21.09)},
            "6 actions": {"Sokoban": Cell(s("SimpleSokoban", actions=6), "SimpleSokoban",
                                          33.59)}}),
        # What a trained model is read against (issue 38), per env: the solver's and the best
        # constant move's exact expected success (lakes: the solver under the run's action
        # budget, as its demonstrations play, and one move a turn for max_turn turns; the
        # constant move one a turn), the untrained model, SFT alone and SFT then RL (the
        # StarPO-S run of a cpu / gpu variant, which warm-starts with SFT). Each lake's column
        # is a run trained on that lake (the solver's demonstrations differ: on the slippery
        # lake it steps sideways around holes it could slide into); each lake's runs are
        # evaluated on the other lake too (in their eval/ JSON).
        "baselines": ("Baselines: exact policies, the untrained model, SFT, SFT then RL",
                      ("FrozenLake", "FrozenLakeNonSlippery", "Sokoban", "Bandit"), {
            # the solver's demonstrations play the env's action budget (several moves a turn),
            # the best any policy can; one move a turn, the stationary solver's
            "solver (exact)": {t: Cell(None, t, None, exact="budget optimum")
                               for t in ("FrozenLake", "FrozenLakeNonSlippery")},
            "solver, one move a turn (exact)": {t: Cell(None, t, None, exact="solver")
                                                for t in ("FrozenLake", "FrozenLakeNonSlippery")},
            "best constant move (exact)": {t: Cell(None, t, None, exact="best constant move")
                                           for t in ("FrozenLake", "FrozenLakeNonSlippery")},
            **{row: {"FrozenLake": Cell(Run(algo, "FrozenLake"), "FrozenLake", None),
                     # the untrained model is the same for both lakes: one evaluation
                     "FrozenLakeNonSlippery": Cell(
                         Run(algo, "FrozenLake" if algo == "untrained" else
                             "FrozenLakeNonSlippery"), "FrozenLakeNonSlippery", None),
                     "Sokoban": Cell(Run(algo, "SimpleSokoban"), "SimpleSokoban", None),
                     "Bandit": Cell(Run(algo, "Bandit"), "Bandit", None)}
               for row, algo in (("untrained", "untrained"), ("SFT", "SFT"),
                                 ("SFT then RL", "StarPO-S"))},
            # issue 38's "SFT then RL >= SFT alone": the RL run's evaluation plays its SFT
            # run's checkpoint too, on the same levels with the same keys (`launch/eval.py
            # --against`), under a variant whose RL starts from the SFT row (cpu, gpu)
            PAIRED_ROW: {c: Cell(Run("StarPO-S", e), e, None, paired=True) for c, e in (
                ("FrozenLake", "FrozenLake"), ("FrozenLakeNonSlippery", "FrozenLakeNonSlippery"),
                ("Sokoban", "SimpleSokoban"), ("Bandit", "Bandit"))}}),
        # Table 2: 4 responses per prompt: Sokoban 20.70, NewVocab 25.39, FrozenLake 21.48 (the
        # batch kept at 8 x 16 = 128 episodes: 32 prompts x 4).
        "responses_per_prompt": ("Table 2: StarPO-S with N responses per prompt (same "
                                 + "episodes per batch)", ("Sokoban", "NewVocab", "FrozenLake"), {
            "4 responses": {
                "Sokoban": Cell(s("SimpleSokoban", responses=4), "SimpleSokoban", 20.70),
                "NewVocab": Cell(s("SimpleSokoban", responses=4), "SokobanDifferentGridVocab",
                                 25.39),
                "FrozenLake": Cell(s("FrozenLake", responses=4), "FrozenLake", 21.48)}}),
    }


PAIRED_ROW = "SFT then RL minus SFT (paired)"
TABLES = _tables()


def selected(table: str, rows=(), columns=()):
    """{row: {column: Cell}} of `table`, only `rows` / `columns` where given (ValueError for
    labels the table lacks)."""
    _, cols, body = TABLES[table]
    for kind, wanted, known in (("row", rows, list(body)), ("column", columns, list(cols))):
        unknown = [w for w in wanted if w not in known]
        if unknown:
            raise ValueError(f"table {table} has no {kind} {', '.join(map(repr, unknown))}; "
                             f"its {kind}s: {', '.join(known)}")
    return {r: {c: cell for c, cell in cells.items() if not columns or c in columns}
            for r, cells in body.items() if not rows or r in rows}


def config_spec(env: str, variant: str) -> str:
    return f"configs/{CONFIG_FILE[env]}" + (f":{variant}" if variant else "")


def base_config(env: str, variant: str):
    import importlib

    return importlib.import_module("configs." + CONFIG_FILE[env][:-3]).get_config(variant or None)


def steps_of(run: Run, variant: str, steps: int) -> int:
    """Training steps of `run`: --steps, else the config's RL steps; SFT trains as many (the
    paper's protocol), or, where the config's RL runs warm-start with SFT (the cpu and gpu
    variants: `sft.steps` > 0), exactly that warm start, so that "SFT" is where "SFT then RL"
    started from."""
    if steps:
        return steps
    c = base_config(run.env, variant)
    return c.sft.steps if run.algo == "SFT" and c.sft.steps > 0 else c.trainer.total_steps


def train_command(run: Run, workdir: str, variant: str, model_path: str, steps: int, extra=(),
                  init_from: str = ""):
    """The `launch/train.py` (or sft.py) command line of `run`, as a list. init_from: an SFT
    run's folder the RL run starts from instead of its own warm start (`sft.steps=0`)."""
    c = base_config(run.env, variant)
    launcher = "sft.py" if run.algo == "SFT" else "train.py"
    o = dict(ENV_OVERRIDES.get(run.env, {}))
    if model_path:
        o["model.path"] = model_path
    if init_from:
        o["model.init_from"], o["sft.steps"] = init_from, 0
    if run.algo != "SFT":
        o.update({f"algorithm.{k}": v for k, v in ALGORITHMS[run.algo].items()})
    if not run.think:
        o["rollout.enable_think"] = False
    if run.actions:
        o["rollout.max_actions_per_turn"] = run.actions
    if run.responses:
        episodes = c.rollout.env_groups * c.rollout.group_size
        if episodes % run.responses:
            raise ValueError(f"{run.responses} responses per prompt do not divide the "
                             f"{episodes} episodes of {config_spec(run.env, variant)}")
        o["rollout.env_groups"], o["rollout.group_size"] = episodes // run.responses, run.responses
    if run.seed:
        o["seed"] = run.seed
    o["val.tags"] = VAL_TAGS[run.env]
    o["sft.steps" if run.algo == "SFT" else "trainer.total_steps"] = steps_of(run, variant, steps)
    args = [f"--config={config_spec(run.env, variant)}", f"--workdir={run_dir(workdir, run)}"]
    args += [f"--config.{k}={v}" for k, v in o.items()]
    args += [f"--config.{kv}" for kv in extra]
    return [sys.executable, os.path.join(HERE, launcher), *args]


def eval_command(run: Run, workdir: str, tags, groups: int, variant: str = "",
                 model_path: str = "", against: str = ""):
    """The `launch/eval.py` command of `run` on `tags`: its checkpoint, or for "untrained" the
    config's initial model; against: a run folder played on the same levels and keys (its
    results and the paired difference go into the same JSON)."""
    out = os.path.join(run_dir(workdir, run), "eval", "+".join(tags) + ".json")
    source = [f"--checkpoint={run_dir(workdir, run)}"]
    if run.algo == "untrained":
        source = [f"--config={config_spec(run.env, variant)}"] + (
            [f"--config.model.path={model_path}"] if model_path else []) + (
            [f"--config.seed={run.seed}"] if run.seed else [])
    return [sys.executable, os.path.join(HERE, "eval.py"), *source, f"--tags={','.join(tags)}",
            f"--out={out}"] + ([f"--groups={groups}"] if groups else []) + (
                [f"--against={against}"] if against else [])


def run_dir(workdir: str, run: Run) -> str:
    return os.path.join(workdir, run.name)


def finished(workdir: str, run: Run, steps: int) -> bool:
    """Whether `run` has a complete checkpoint at step `steps` (or later)."""
    directory = os.path.join(run_dir(workdir, run), "checkpoints")
    if not os.path.isdir(directory):
        return False
    from starpo import checkpoint

    reader = checkpoint.Checkpointer(directory, read_only=True)
    try:
        return (reader.latest_step() or 0) >= steps
    finally:
        reader.close()


def results(workdir: str, run: Run, paired: bool = False) -> dict:
    """{tag: {"success": ..., ..., "groups", "temperature"}} of every evaluation of `run`;
    paired: {tag: {"success_diff", "success_diff_stderr", ..., "against", "groups",
    "temperature"}} of those that played another checkpoint beside it (`--against`)."""
    folder, out = os.path.join(run_dir(workdir, run), "eval"), {}
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    line = json.loads(f.read())
                found = line.get("paired", {}) if paired else line["results"]
                extra = {"against": line["against"]["model"]} if paired and found else {}
                for tag, r in found.items():
                    out[tag] = dict(r, groups=line["groups"], temperature=line["temperature"],
                                    **extra)
    return out


def plan(tables, workdir, variant="", model_path="", steps=0, eval_groups=0, rows=(),
         columns=(), extra=(), seeds=(0,)):
    """[(command, done)]: each run's training then its evaluation on the tags it lacks, in
    table order, every run once per seed."""
    return [(command, done) for command, done, _ in planned_runs(
        tables, workdir, variant, model_path, steps, eval_groups, rows, columns, extra, seeds)]


def planned_runs(tables, workdir, variant="", model_path="", steps=0, eval_groups=0, rows=(),
                 columns=(), extra=(), seeds=(0,)):
    """`plan`'s [(command, done, run)]: with the run each command trains or evaluates."""
    def warm_starts(env):  # a cpu / gpu variant's RL runs start from an SFT run (not --steps)
        return not steps and base_config(env, variant).sft.steps > 0

    needs = {}  # run -> tags, in order
    for table in tables:
        for cells in selected(table, rows, columns).values():
            for cell in cells.values():
                if cell.run is None:  # an exact figure: computed when the table is printed
                    continue
                for seed in seeds:
                    runs = [dataclasses.replace(cell.run, seed=seed)]
                    if cell.paired and warm_starts(cell.run.env):
                        # RL starts from the SFT run, and its evaluation plays that run too
                        runs.append(dataclasses.replace(runs[0], algo="SFT"))
                    for run in runs:
                        tags = needs.setdefault(run, [])
                        for t in (cell.tag, *ALSO_EVALUATED.get(cell.run.env, ())):
                            if t not in tags:  # the untrained model's lake is both lakes' own
                                tags.append(t)
    out, emitted = [], set()
    # Under a warm-starting variant (cpu, gpu: sft.steps > 0) an RL run whose SFT row is in
    # the plan starts from that row's weights instead of training the same warm start again
    # (same config and seed: the same SFT), so "SFT then RL" starts exactly where "SFT" ends,
    # one SFT per env and seed; that SFT run then comes first.
    def shares(run):
        sft = dataclasses.replace(run, algo="SFT")
        return sft if (run.algo not in ("SFT", "untrained") and sft in needs
                       and warm_starts(run.env)) else None

    def emit(run):
        if run in emitted:
            return
        emitted.add(run)
        sft = None
        if run.algo != "untrained":
            sft = shares(run)
            if sft is not None:
                emit(sft)
            done = finished(workdir, run, steps_of(run, variant, steps))
            out.append((train_command(run, workdir, variant, model_path, steps, extra,
                                      init_from=run_dir(workdir, sft) if sft else ""), done,
                        run))
        # an RL run started from the SFT row is evaluated beside it (the paired row)
        have = results(workdir, run, paired=sft is not None)
        missing = [t for t in needs[run] if t not in have]
        out.append((eval_command(run, workdir, missing or needs[run], eval_groups, variant,
                                 model_path, against=run_dir(workdir, sft) if sft else ""),
                    not missing, run))

    for run in needs:
        emit(run)
    return out


def shown(command) -> str:
    """A command line as a user would type it from the current directory."""
    script = os.path.relpath(command[1])
    return shlex.join(["python", script if not script.startswith("..") else command[1],
                       *command[2:]])


def cell_text(ours, cell: Cell, spread=None, paired_stderr=None) -> str:
    """`ours / paper`; spread (standard error, seeds) where ours is a mean over seeds; a
    paired cell's difference is signed, with its evaluation's standard error where one seed."""
    paper = "—" if cell.paper is None else ("~" if cell.approx else "") + f"{cell.paper:g}"
    mine = "pending" if ours is None else f"{ours:+.2f}" if cell.paired else f"{ours:.2f}"
    if ours is not None and spread and spread[1] > 1:
        mine += f" ±{spread[0]:.2f} ({spread[1]} seeds)"
    elif ours is not None and paired_stderr is not None:
        mine += f" ±{paired_stderr:.2f} (paired)"
    return f"{mine} / {paper}"


def over_seeds(values: list[float]) -> tuple[float | None, tuple[float, int] | None]:
    """(mean, (standard error of the mean, n)) of per-seed values; (None, None) if none."""
    if not values:
        return None, None
    n, mean = len(values), sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, ((var / n) ** 0.5, n)


def exact_figure(cell: Cell, variant: str, groups: int) -> float:
    """An exact cell's expected success (%): its lake_baselines policy on the validation
    levels, one move a turn for the variant's rollout.max_turn turns (the budget optimum:
    up to the run's action budget a turn and an episode)."""
    import envs
    from envs import text
    from experiments import lake_baselines

    c = base_config("FrozenLake", variant)
    budget = text.make_text(envs.make("FrozenLake", **c.env.options.to_dict()),
                            c.rollout.max_actions_per_turn or None,
                            c.rollout.max_actions_per_traj or None)
    figures = lake_baselines.exact_success(groups or c.val.env_groups, c.rollout.max_turn,
                                           slippery=cell.tag == "FrozenLake",
                                           per_turn=budget.max_actions_per_turn,
                                           per_episode=budget.max_actions_per_traj)
    return 100 * figures[cell.exact]


def table_data(table: str, workdir: str, rows=(), columns=(), variant: str = "",
               groups: int = 0, seeds=(0,)):
    """[(row, column, Cell, ours %, eval info, {seed: %})] of the finished evaluations (ours:
    the mean over the seeds evaluated, None where none is yet) and the exact figures."""
    out, cache = [], {}
    for row, cells in selected(table, rows, columns).items():
        for column, cell in cells.items():
            if cell.run is None:
                out.append((row, column, cell, exact_figure(cell, variant, groups), None, {}))
                continue
            per_seed, info = {}, None
            for seed in seeds:
                run = dataclasses.replace(cell.run, seed=seed)
                r = cache.setdefault((run, cell.paired),
                                     results(workdir, run, cell.paired)).get(cell.tag)
                if r is not None:
                    per_seed[seed] = 100 * r["success_diff" if cell.paired else "success"]
                    info = r
            mean, _ = over_seeds(list(per_seed.values()))
            out.append((row, column, cell, mean, info, per_seed))
    return out


def format_table(table: str, workdir: str, rows=(), columns=(), variant: str = "",
                 groups: int = 0, seeds=(0,)) -> str:
    """The table in the paper's layout: `ours / paper` success (%) per cell (a mean over seeds
    with its standard error where several), notes, a JSON line."""
    title, all_columns, _ = TABLES[table]
    data = table_data(table, workdir, rows, columns, variant, groups, seeds)
    cols = [c for c in all_columns if any(d[1] == c for d in data)]
    body = {}
    for row, column, cell, ours, info, per_seed in data:
        stderr = 100 * info["success_diff_stderr"] if cell.paired and info else None
        body.setdefault(row, {})[column] = cell_text(ours, cell,
                                                     over_seeds(list(per_seed.values()))[1],
                                                     stderr)
    head = ["", *cols]
    lines = [[r, *(body[r].get(c, "") for c in cols)] for r in body]
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    evals = {(r["groups"], r["temperature"]) for *_, r, _ in data if r}
    sets = ", ".join(f"{g} levels at temperature {t:g}" for g, t in sorted(evals))
    text = [f"{title}: success %, ours / paper's" + (f" (ours on {sets})" if evals else ""),
            fmt.format(*head), "-+-".join("-" * w for w in widths),
            *(fmt.format(*x) for x in lines)]
    renamed = sorted({(PAPER_NAME[cell.tag], cell.tag) for _, _, cell, *_ in data
                      if cell.tag in PAPER_NAME})
    if renamed:
        text.append("env variants: " + ", ".join(f"{p} = our {t}" for p, t in renamed))
    if any(cell.paired for _, _, cell, *_ in data):
        text.append(f"{PAIRED_ROW}: points of success the RL run gained over the SFT run it "
                    "started from, both played on the same levels with the same keys (its "
                    "evaluation's standard error where one seed)")
    if any(cell.approx for _, _, cell, *_ in data):
        text.append("~: the paper's vanilla StarPO peaks there before it collapses (read off its "
                    "figures); ours is the last checkpoint")
    runs = sorted({dataclasses.replace(cell.run, seed=seed).name for _, _, cell, *_ in data
                   if cell.run for seed in seeds})
    text.append(f"runs in {workdir}: {', '.join(runs)}")
    text.append(json.dumps({"table": table, "cells": [
        {"row": row, "column": column, "tag": cell.tag,
         "run": cell.run.name if cell.run else "exact: " + cell.exact,
         "ours": None if ours is None else round(ours, 2), "paper": cell.paper,
         **({"seeds": {str(k): round(v, 2) for k, v in per_seed.items()}}
            if len(seeds) > 1 else {})}
        for row, column, cell, ours, _, per_seed in data]}))
    return "\n".join(text)


def main(argv):
    if len(argv) > 1:
        raise ValueError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.table is None:
        raise ValueError(f"--table is required: one of {', '.join(TABLE_NAMES)}, all")
    tables = TABLE_NAMES if FLAGS.table == "all" else (FLAGS.table,)
    if FLAGS.table == "all" and (FLAGS.rows or FLAGS.columns):
        raise ValueError("--rows / --columns name one table's labels: give one --table")
    for table in tables:
        selected(table, FLAGS.rows, FLAGS.columns)  # unknown labels fail here
    for kv in FLAGS.set:
        if "=" not in kv:
            raise ValueError(f"--set {kv!r}: expected KEY=VALUE, e.g. model.dtype=bfloat16")
    seeds = seed_list(FLAGS.seeds)
    if FLAGS.print_only:
        print("\n\n".join(format_table(t, FLAGS.workdir, FLAGS.rows, FLAGS.columns,
                                        FLAGS.variant, FLAGS.eval_groups, seeds)
                          for t in tables))
        return
    if FLAGS.model_path:
        from starpo import weights

        weights.model_kind(FLAGS.model_path)  # a missing or unknown model: LoadError, one line
    check(plan(tables, FLAGS.workdir, **settings()))
    if FLAGS.dry_run:
        for command, done in plan(tables, FLAGS.workdir, **settings()):
            print(("# done: " if done else "") + shown(command))
        return
    from starpo import harness

    harness.check_can_create(FLAGS.workdir, "--workdir")  # before the first run starts
    reproduce(tables, FLAGS.workdir, parallel=FLAGS.parallel, **settings())
    print("\n\n".join(format_table(t, FLAGS.workdir, FLAGS.rows, FLAGS.columns, FLAGS.variant,
                                    FLAGS.eval_groups, seeds) for t in tables))


def check(commands) -> None:
    """Every training command's config parsed and checked as its launcher will (unknown keys,
    wrong types, values the run cannot use): ValueError naming the run, before any work."""
    trained = set()  # the runs the plan trains before: an RL run may start from one of them
    for command, _ in commands:
        if command[1].endswith("eval.py"):
            continue
        planned = {f"--config.model.init_from={w}" for w in trained}
        argv = ["reproduce", *(a for a in command[2:]
                               if a.startswith("--config") and a not in planned)]
        trained.add(next(a for a in command if a.startswith("--workdir=")).split("=", 1)[1])
        values = flags.FlagValues()
        holder = common.define_config("config", flag_values=values, sys_argv=argv)
        try:
            common.parse_flags(argv, values, holder, check_config=True)
        except common.UsageError as e:
            run = os.path.basename(next(a for a in command if a.startswith("--workdir=")))
            raise ValueError(f"run {run}: {e}") from None


def seed_list(values) -> tuple[int, ...]:
    """--seeds as distinct non-negative ints, in order (ValueError otherwise)."""
    out = []
    for v in values:
        if not v.strip().isdigit():
            raise ValueError(f"--seeds: {v!r} is not a non-negative integer")
        out += [] if int(v) in out else [int(v)]
    if not out:
        raise ValueError("--seeds: give at least one seed")
    return tuple(out)


def settings() -> dict:
    """`plan`'s settings from the flags."""
    return {"variant": FLAGS.variant, "model_path": FLAGS.model_path, "steps": FLAGS.steps,
            "eval_groups": FLAGS.eval_groups, "rows": FLAGS.rows, "columns": FLAGS.columns,
            "extra": FLAGS.set, "seeds": seed_list(FLAGS.seeds)}


def reproduce(tables, workdir, runner=subprocess.run, parallel=1, **kw):
    """Run `plan`'s commands that are not done (`runner`: subprocess.run): one after another,
    or with `parallel` > 1 each seed's commands in order, up to `parallel` seeds at once (the
    runs of different seeds share nothing). A failing command ends its seed's commands; the
    reproduction then exits with the first failure's status once the other seeds are done
    (75: stopped on request; the same command resumes)."""
    commands = planned_runs(tables, workdir, **kw)
    chains = {}  # seed -> [index of each command not done], in plan order
    for i, (_, done, run) in enumerate(commands):
        if not done:
            chains.setdefault(run.seed if parallel > 1 else 0, []).append(i)
    width = min(parallel, len(chains))  # seeds at once

    def run_chain(seed, indices):
        for i in indices:
            command = commands[i][0]
            if command[1].endswith("eval.py"):  # the tags still missing, now training is done
                command = plan(tables, workdir, **kw)[i][0]
            if width <= 1:
                print(f"reproduce: {shown(command)}", file=sys.stderr, flush=True)
                rc = runner(command, check=False).returncode
            else:
                rc = run_logged(runner, command, commands[i][2], workdir, width)
            if rc:
                print(f"error: {os.path.basename(command[1])} exited with status {rc}: "
                      f"{shown(command)}", file=sys.stderr, flush=True)
                return rc
        return 0

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(width, 1)) as pool:  # one worker: in plan order
        futures = [pool.submit(run_chain, seed, indices) for seed, indices in chains.items()]
        statuses = [f.result() for f in futures]
    failed = [rc for rc in statuses if rc]
    if failed:
        sys.exit(failed[0])


def run_logged(runner, command, run, workdir: str, parallel: int) -> int:
    """One command of a seed's, beside `parallel` - 1 others: its output into
    --workdir/logs/<run>.<launcher>.log, a line when it starts and ends, and its share of an
    accelerator's memory (a fraction the user set is kept)."""
    os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
    launcher = os.path.basename(command[1])[:-3]
    log = os.path.join(workdir, "logs", f"{run.name}.{launcher}.log")
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / parallel:.2f}")
    print(f"reproduce: [seed {run.seed}] {shown(command)} (output: {log})", file=sys.stderr,
          flush=True)
    start = time.monotonic()
    with open(log, "a", encoding="utf-8") as out:
        rc = runner(command, check=False, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    print(f"reproduce: [seed {run.seed}] {run.name} {launcher} "
          f"{'done' if rc == 0 else f'exited with status {rc}'} in {time.monotonic() - start:.0f} s",
          file=sys.stderr, flush=True)
    return rc


def cli():
    """The `starpo-reproduce` command (pyproject.toml)."""
    common.run(main)


if __name__ == "__main__":
    cli()
