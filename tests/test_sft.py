"""Solver demonstrations and the SFT phase (starpo/demos.py, starpo/sft.py).

The demonstrations are checked against slow Python references written here: each reply is
decoded from the Trajectory's model tokens, its moves replayed on the level's text grid, and
their count compared with a breadth-first search over the text (FrozenLake) or the env's
host search (Sokoban). The SFT phase trains the tiny FrozenLake model from scratch: its loss
must fall and its validation answers turn valid; an interrupted phase resumes exactly; the RL
run after it starts from its weights.
"""

import collections
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs
from configs import frozenlake, sokoban, sudoku
from starpo import checkpoint, config_check, demos, experiment, harness, metrics, rollout
from starpo import run_config, sft, training
from starpo import model as model_lib
from starpo import update as update_lib
from tests.test_training import with_changes

LAKE_MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}


def replies(tokenizer, traj, row):
    """The decoded model text of each turn of episode `row`."""
    tokens, mask = np.asarray(traj.tokens[row]), np.asarray(traj.loss_mask[row])
    turn = np.asarray(traj.turn_index[row])
    return [tokenizer.decode(tokens[mask & (turn == k)].tolist())
            for k in range(int(turn.max()) + 1) if (mask & (turn == k)).any()]


def answer_moves(reply, thinking):
    """Action names of one reply, lower-case."""
    text = reply.split("<answer>")[1] if thinking else reply
    return [m.strip().lower() for m in text.split("</answer>")[0].split("||")]


def lake_distance(rows, start):
    """Fewest hole-free moves from `start` to the goal on the text grid (None: unreachable)."""
    n = len(rows)
    seen, queue = {start: 0}, collections.deque([start])
    while queue:
        r, c = queue.popleft()
        if rows[r][c] == "G":
            return seen[(r, c)]
        for dr, dc in LAKE_MOVES.values():
            q = (r + dr, c + dc)
            if 0 <= q[0] < n and 0 <= q[1] < n and rows[q[0]][q[1]] != "O" and q not in seen:
                seen[q] = seen[(r, c)] + 1
                queue.append(q)
    return None


@pytest.fixture(scope="module")
def lake():
    config = frozenlake.get_config("tiny")
    return config, experiment.load_policy(config)


def test_lake_demonstrations_walk_a_shortest_path(lake):
    """Tiny FrozenLake (3x3, non-slippery, one move per reply, 5 turns): every reply is one
    move along a shortest hole-free path (the text BFS's distance falls by one each move),
    and the episode succeeds exactly when that distance is within the 5 turns."""
    config, policy = lake
    env = run_config.make_env(config, config.env.name)
    spec = run_config.rollout_spec(config)
    play = demos.make_demo_rollout(env, policy.tokenizer, spec)
    states, _ = rollout.initial_states(env, jax.random.key(0), 0, rollout.TRAIN, 96, 1)
    traj, _, weight = jax.device_get(play(states, jax.random.key(1)))
    assert weight.min() == 1.0  # the generator only makes solvable lakes
    checked = 0
    for row in range(96):
        rows = env.to_text(jax.tree_util.tree_map(lambda x, row=row: x[row], states)).split("\n")
        pos = next((r, line.index("P")) for r, line in enumerate(rows) if "P" in line)
        dist = lake_distance(rows, pos)
        moves = [m for reply in replies(policy.tokenizer, traj, row)
                 for m in answer_moves(reply, thinking=False)]
        assert len(moves) == min(dist, spec.max_turn), (row, rows, moves)
        for m in moves:
            pos = (pos[0] + LAKE_MOVES[m][0], pos[1] + LAKE_MOVES[m][1])
            assert lake_distance(rows, pos) == dist - 1, (row, rows, moves)
            dist -= 1
        assert bool(traj.success[row]) == (dist == 0), (row, rows, moves)
        checked += 1
    assert checked == 96


def test_slippery_lake_demonstrations_play_the_budget(tiny_tokenizer):
    """The paper's slippery 4x4 lake, 5 turns of up to 5 moves, 10 an episode: the replies
    write up to 5 moves each and 10 in all, several in one reply on some levels (the budget
    plan, `solvers.lake_budget_moves`), and 128 episodes succeed as often as the plan's exact
    success on their levels (experiments/lake_baselines.py's `budget_optimum`, 0.48 on the
    validation levels) within 3.5 standard errors: one move a turn (0.28) would fall outside."""
    from configs.frozenlake import OPTIONS
    from experiments import lake_baselines

    env = envs.make("FrozenLake", **OPTIONS)
    spec = rollout.RolloutSpec(max_turn=5, max_new_tokens=48, max_context=2048, thinking=False)
    play = demos.make_demo_rollout(env, tiny_tokenizer, spec)
    levels = 128
    states, _ = rollout.initial_states(env, jax.random.key(0), 0, rollout.TRAIN, levels, 1)
    traj, _, weight = jax.device_get(play(states, jax.random.key(1)))
    counts = [[len(answer_moves(t, thinking=False)) for t in replies(tiny_tokenizer, traj, row)]
              for row in range(levels)]
    assert all(1 <= c <= 5 for row in counts for c in row) and max(map(sum, counts)) <= 10
    assert max(max(row) for row in counts) > 1
    grids, starts = np.asarray(states.grid), np.asarray(states.pos)
    exact = np.mean([lake_baselines.budget_optimum(grids[i], starts[i], 5, 5, 10)
                     for i in range(levels)])
    one_a_turn = np.mean([lake_baselines.success(grids[i], starts[i], 5, None)
                          for i in range(levels)])
    played = np.mean(traj.success[weight > 0]) * (weight > 0).mean()
    se = np.sqrt(exact * (1 - exact) / levels)
    assert abs(played - exact) < 3.5 * se and played > one_a_turn + 2 * se, (
        played, exact, one_a_turn)


def sokoban_play(rows, moves):
    """Replay moves on a Sokoban text grid (the env's push rules); True when every box is on
    a target."""
    grid = [list(r) for r in rows]
    boxes = {(r, c) for r, line in enumerate(grid) for c, ch in enumerate(line) if ch in "X√"}
    targets = {(r, c) for r, line in enumerate(grid) for c, ch in enumerate(line) if ch in "O√S"}
    wall = {(r, c) for r, line in enumerate(grid) for c, ch in enumerate(line) if ch == "#"}
    pos = next((r, c) for r, line in enumerate(grid) for c, ch in enumerate(line) if ch in "PS")
    step = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
    for m in moves:
        d = step[m]
        ahead = (pos[0] + d[0], pos[1] + d[1])
        if ahead in wall:
            continue
        if ahead in boxes:
            beyond = (ahead[0] + d[0], ahead[1] + d[1])
            if beyond in wall or beyond in boxes:
                continue
            boxes = (boxes - {ahead}) | {beyond}
        pos = ahead
    return boxes <= targets


def test_sokoban_demonstrations_solve_in_the_fewest_moves(tiny_tokenizer):
    """SimpleSokoban with thinking on and up to 5 moves per reply (10 per episode): the
    replies' moves, replayed on the text grid, solve every level whose shortest solution
    (the env's host search) fits the budget, with exactly that many moves."""
    env = envs.make("SimpleSokoban")
    spec = rollout.RolloutSpec(max_turn=3, max_new_tokens=48, max_context=2048)
    play = demos.make_demo_rollout(env, tiny_tokenizer, spec)
    states, _ = rollout.initial_states(env, jax.random.key(0), 0, rollout.TRAIN, 24, 1)
    traj, _, weight = jax.device_get(play(states, jax.random.key(1)))
    solved = 0
    for row in range(24):
        state = jax.tree_util.tree_map(lambda x, row=row: x[row], states)
        shortest = envs.sokoban.solve(state)
        texts = replies(tiny_tokenizer, traj, row)
        assert all(t.startswith("Plan: ") for t in texts), texts
        moves = [m for t in texts for m in answer_moves(t, thinking=True)]
        assert weight[row] == float(shortest >= 0)
        if 0 <= shortest <= 10:
            assert len(moves) == shortest, (row, texts)
            assert sokoban_play(env.to_text(state).split("\n"), moves), (row, texts)
            assert traj.success[row]
            solved += 1
    assert solved >= 12  # most levels of the reference's generator are short


def test_sft_learns_resumes_and_hands_over_to_rl(lake, tmp_path, capfd):
    """24 SFT steps of 32 demonstrations on the tiny FrozenLake model from scratch: the loss
    falls by more than half, validation answers go from mostly invalid to valid, and the
    held-out demonstrations' NLL halves while their greedy accuracy rises; a 12-step
    phase stopped at step 5 and resumed logs the losses of the straight run's first 12 steps
    (the learning rate is constant: the phase's length changes nothing before its end); RL then
    starts from the SFT weights (its step-0 validation equals SFT's last, same levels and
    key). The straight run asks for its bar with a console that is no terminal (pytest's
    capture): each step's line begins a line, no carriage-return frames."""
    config, policy = lake
    config = with_changes(config, sft__steps=24, sft__lr=3e-3, sft__test_freq=24,
                          sft__save_freq=0, trainer__total_steps=0)
    exp = experiment.build(config, policy)
    quiet = lambda *a, **k: None  # noqa: E731
    straight = str(tmp_path / "straight")
    capfd.readouterr()
    with jax.set_mesh(exp.mesh):
        run = run_config.read(config)
        sft.run(run, straight, exp, sft.build(run, exp), progress=True)
    out, err = capfd.readouterr()
    steps = [s.split(" |")[0] for s in out.splitlines() if s.startswith("sft ")]
    assert "\r" not in out + err and steps == [f"sft {n}/24" for n in range(25)], (out, err)
    resumed, shorter = str(tmp_path / "run"), with_changes(config, sft__steps=12)
    training.train(shorter, resumed, progress=False, experiment=exp, log=quiet, stop_after=5)
    assert not os.path.exists(os.path.join(resumed, "metrics.jsonl"))  # RL has not started
    training.train(shorter, resumed, progress=False, experiment=exp, log=quiet)

    def series(workdir, name):
        return [(r["step"], r[name]) for r in metrics.read_jsonl(
            os.path.join(workdir, "metrics.jsonl")) if name in r]

    loss = series(straight, "sft/loss")
    assert [s for s, _ in loss] == list(range(1, 25))
    assert loss[-1][1] < 0.5 * loss[0][1], loss
    again = series(os.path.join(resumed, "sft"), "sft/loss")
    assert [s for s, _ in again] == list(range(1, 13))
    assert [x for _, x in again] == pytest.approx([x for _, x in loss[:12]], rel=1e-5)
    valid = series(straight, "val/FrozenLake/action_is_valid")
    assert valid[0][0] == 0 and valid[0][1] < 0.2, valid
    assert valid[-1][0] == 24 and valid[-1][1] >= 0.9, valid
    assert series(straight, "val/FrozenLake/solver_success")[0][1] >= 0.95
    # the held-out demonstrations: the NLL falls, and the greedy answers match the solver's
    # more often than at the start and than its most common reply alone
    nll = series(straight, "val/FrozenLake/demo_nll")
    accuracy = series(straight, "val/FrozenLake/demo_accuracy")
    assert [s for s, _ in nll] == [0, 24] and nll[1][1] < 0.5 * nll[0][1], nll
    constant = series(straight, "val/FrozenLake/demo_constant")[0][1]
    assert 0 < constant < 1 and accuracy[1][1] > max(accuracy[0][1], constant), (accuracy,
                                                                                constant)
    sft_last = metrics.read_jsonl(os.path.join(resumed, "sft", "metrics.jsonl"))[-1]
    rl_first = metrics.read_jsonl(os.path.join(resumed, "metrics.jsonl"))[0]
    for name in ("val/FrozenLake/success", "val/FrozenLake/action_is_valid"):
        assert rl_first[name] == sft_last[name], name
    # model.init_from: another run starts from the SFT run's last weights
    later = with_changes(config, sft__steps=0, model__init_from=straight)
    config_check.check(later)
    got = experiment.load_policy(later).params
    want = checkpoint.load_params(os.path.join(straight, "checkpoints"), 24)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, got, want))


def test_sft_learning_rate_warms_up_then_decays_when_asked(lake):
    """sft.lr_decay_steps: the SFT phase's AdamW rate warms up over sft.warmup_steps, then
    falls along a cosine to sft.min_lr_ratio x sft.lr over that many steps (one AdamW step an
    SFT step); RL's schedule stays the algorithm's. Off (0), it is constant after the warm-up."""
    config, _ = lake
    on = with_changes(config, sft__lr=1e-3, sft__warmup_steps=2, sft__lr_decay_steps=8,
                      sft__min_lr_ratio=0.1, algorithm__lr_decay_steps=0)
    run = run_config.read(on)
    f = update_lib.algo_lr_schedule(run.sft.algo.actor_lr, run.sft.algo)
    want = [5e-4, 1e-3, 1e-3, 1e-3 * (0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2), 1e-4, 1e-4]
    np.testing.assert_allclose([float(f(c)) for c in (0, 1, 2, 4, 10, 30)], want, rtol=1e-6)
    assert run.algo.lr_decay_steps == 0  # RL's own
    off = run_config.read(with_changes(config, sft__lr=1e-3, sft__warmup_steps=2)).sft.algo
    g = update_lib.algo_lr_schedule(off.actor_lr, off)
    np.testing.assert_allclose([float(g(c)) for c in (2, 100)], [1e-3, 1e-3], rtol=1e-6)


def test_bad_sft_configs_fail_at_start(lake, tmp_path):
    config, _ = lake
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    (other / "config.json").write_text(harness.config_json(with_changes(
        config, model__path="tiny:layers=1,hidden=32,heads=2,kv_heads=1,head_dim=16,mlp=64")))
    with pytest.raises(run_config.ConfigError, match="holds a run of model 'tiny:layers=1"):
        config_check.check(with_changes(config, model__init_from=str(other)))
    with pytest.raises(run_config.ConfigError, match="model.init_from: .* is not a training"):
        config_check.check(with_changes(config, model__init_from=str(tmp_path / "none")))
    bad = [
        (dict(sft__steps=1, sft__env_groups=48), "sft.env_groups 48 is not a multiple"),
        (dict(sft__steps=1, sft__lr=0.0), "sft.lr must be"),
        (dict(sft__steps=-1), "sft.steps must be"),
    ]
    for changes, message in bad:
        with pytest.raises(run_config.ConfigError, match=message):
            config_check.check(with_changes(config, **changes))
    # two Sudoku placements a reply: a table of 729 + 729^2 replies, refused before any work
    two = with_changes(sudoku.get_config("tiny"), sft__steps=1, sft__actions_per_turn=2,
                       env__name="SimpleSudoku", env__options__size=9, env__options__blanks=32,
                       rollout__max_actions_per_turn=2)
    with pytest.raises(run_config.ConfigError, match="sft.actions_per_turn=2: .* use 1"):
        config_check.check(two)
    three = with_changes(sokoban.get_config("tiny"), sft__steps=1, env__options__num_boxes=3)
    with pytest.raises(run_config.ConfigError, match="sft: no solver for 'SimpleSokoban'"):
        config_check.check(three)
    mixed = with_changes(config, sft__steps=1, env__mix="FrozenLake:128")
    with pytest.raises(ValueError, match="sft"):
        config_check.check(mixed)
    with pytest.raises(run_config.ConfigError, match="sft.steps must be > 0"):
        sft.train_only(config, "/nonexistent/never-written")
    # a reply that cannot fit the reply budget: two moves where the tiny config allows one token
    with pytest.raises(ValueError, match="does not fit rollout.response_length=1"):
        demos.make_demo_rollout(run_config.make_env(config, "FrozenLake"),
                                experiment.load_policy(config).tokenizer,
                                run_config.rollout_spec(config), actions_per_turn=2)


def test_held_out_demonstrations_are_scored_token_by_token(lake):
    """`sft.make_scorer` against a slow reference: the full logits of each row (one forward,
    no chunks, no micro-batches), the NLL summed over reply tokens and, per turn, whether
    every reply token is the logits' argmax, weighted by the rows' weights."""
    config, policy = lake
    config = with_changes(config, algorithm__logit_chunk_size=8, algorithm__micro_batch_size=4)
    env = run_config.make_env(config, config.env.name)
    play = demos.make_demo_rollout(env, policy.tokenizer, run_config.rollout_spec(config))
    states, _ = rollout.initial_states(env, jax.random.key(0), 0, rollout.TRAIN, 6, 1)
    traj, _, _ = play(states, jax.random.key(1))
    weight = np.asarray([1.0, 0.0, 1.0, 1.0, 0.5, 1.0], np.float32)
    # a half-trained model, so that some replies are right and some are not
    trained = with_changes(config, sft__steps=3, sft__lr=3e-3)
    exp = experiment.build(trained, policy)
    phase = sft.build(run_config.read(trained), exp)
    state = phase.init(policy.params)
    for step in range(3):
        state, _ = sft.train_step(phase, exp, state, step)
    # the three steps' demonstrations came from one call (`Phase.demos`), each the solver's
    # episodes of its own levels (seeds step * sft.env_groups ..) with its own key
    assert phase.demo_steps == 3 and phase.played[0] == 0
    G = trained.sft.env_groups
    for step in (0, 2):
        levels, _ = rollout.initial_states(env, jax.random.key(trained.seed), step * G,
                                           rollout.TRAIN, G, 1)
        alone = play(levels, jax.random.fold_in(jax.random.key(trained.seed), step))
        jax.tree_util.tree_map(np.testing.assert_array_equal, phase.demos_of(step), alone)
    params = state.actor_params
    got = np.asarray(sft.make_scorer(run_config.sft_algo(config), policy.cfg)(params, traj, weight))

    logits, _ = model_lib.forward(params, policy.cfg, traj.tokens, traj.valid)
    logits, traj = np.asarray(logits, np.float64), jax.device_get(traj)
    want = np.zeros(4)
    for b in range(6):
        for k in range(int(traj.turn_index[b].max()) + 1):
            at = np.flatnonzero(traj.loss_mask[b] & (traj.turn_index[b] == k))
            if not len(at):
                continue
            rows = logits[b, at - 1]
            logp = rows - np.log(np.exp(rows - rows.max(1, keepdims=True)).sum(1,
                                                                           keepdims=True))
            logp -= rows.max(1, keepdims=True)
            tokens = traj.tokens[b, at]
            want += weight[b] * np.array([
                -logp[np.arange(len(at)), tokens].sum(), len(at),
                float(np.all(rows.argmax(1) == tokens)), 1.0])
    assert 0 < want[2] < want[3], want  # some replies right, some wrong: the test can fail
    np.testing.assert_allclose(got, want, rtol=1e-4)


@pytest.mark.parametrize("heads", ["everywhere", "replies"])
def test_sft_step_is_the_weighted_mean_nll_of_reply_tokens(heads):
    """One `sft.make_step` (micro-batches of 2 rows, chunked head) against a plain reference:
    one forward of the whole batch, each reply token's negative log-likelihood weighted by its
    row's weight (weight-0 rows add nothing), summed and divided by the weighted token count;
    the step's loss equals it, and its new weights equal one AdamW step on the reference's
    gradient. `replies`: the output head runs at the reply tokens alone (`reply_positions`, as
    `sft.train_step` calls it), which must change nothing."""
    import optax

    from starpo import update as UP
    from tests.test_update import CFG, random_params, synthetic_trajectory

    traj = synthetic_trajectory(3)
    B = traj.tokens.shape[0]
    weight = np.array([1, 1, 0, 1, 0, 1, 1, 1], np.float32)[:B]
    algo = run_config.AlgoConfig(adv_estimator="grpo", group_size=2, micro_batch_size=2,
                                 ppo_mini_batch_size=2, actor_lr=1e-2, logit_chunk_size=5)
    params = random_params(CFG, 4)
    tokens, mask, length = (np.asarray(x) for x in (traj.tokens, traj.loss_mask, traj.length))

    def reference_loss(p):  # the whole batch at once: no micro-batches, no logit chunks
        valid = jnp.arange(tokens.shape[1])[None] < length[:, None]
        logits = model_lib.forward(p, CFG, jnp.asarray(tokens), valid)[0]
        logp = jax.nn.log_softmax(logits)[:, :-1]  # token t from position t-1
        picked = jnp.take_along_axis(logp, jnp.asarray(tokens[:, 1:, None]), axis=2)[..., 0]
        m = jnp.asarray(mask[:, 1:] * weight[:, None])
        return -jnp.sum(picked * m) / jnp.sum(m)

    reference_loss = jax.jit(reference_loss)
    want_loss = float(reference_loss(params))
    want_grads = jax.jit(jax.grad(reference_loss))(params)
    state = UP.init_train_state(algo, jax.tree_util.tree_map(jnp.array, params))
    tx = UP.make_optimizer(algo.actor_lr, algo)

    @jax.jit  # one program, not one per leaf and operation
    def adamw_step(grads, p):
        return optax.apply_updates(p, tx.update(grads, tx.init(p), p)[0])

    want_params = adamw_step(want_grads, params)

    positions = None
    if heads == "replies":
        positions = UP.reply_positions(traj.loss_mask, UP.reply_count(traj.loss_mask))
        assert positions.shape[1] < tokens.shape[1]  # the head does skip positions
    new, metrics = sft.make_step(algo, CFG)(state, traj, jnp.asarray(weight), positions)
    assert float(metrics["sft/loss"]) == pytest.approx(want_loss, rel=1e-5)
    assert float(metrics["sft/tokens"]) == float((mask * weight[:, None]).sum())
    assert float(metrics["sft/grad_norm"]) == pytest.approx(
        float(optax.global_norm(want_grads)), rel=1e-4)
    for got, want in zip(jax.tree_util.tree_leaves(new.actor_params),
                         jax.tree_util.tree_leaves(want_params)):
        # a first AdamW step is ~lr x sign(g): where |g| is near Adam's eps, float rounding
        # of g moves it by up to a few % of lr (1e-2)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
