"""Several JAX processes on one machine, as on a pod: 2 processes x 2 fake CPU devices joined by
`jax.distributed` over 127.0.0.1, against 1 process x 4 devices (the reference, STEPS steps of
`launch/train.py --config=configs/bandit.py:tiny`, mesh 1 x 4 x 1, a checkpoint every 2 steps).
The 2-process runs name their layout with `mesh.coordinator_address / num_processes /
process_id`; process 0 alone writes metrics.jsonl, whose rows must equal the reference's within
float tolerance:
- a fresh 2-process run of 4 steps: same metrics, same checkpointed weights;
- the reference's checkpoint of step 2 (1 process) resumed in 2 processes; SIGTERM to process 1
  alone stops both at the same step, each saving its shards (exit status 75, one line); that
  checkpoint resumed in 1 process to step STEPS: every step's metrics equal the reference's;
- SIGKILL to process 1: process 0 exits with status 3 and a one-line error naming process 1
  within `mesh.heartbeat_timeout_s`, instead of waiting in a collective for good.
Validation is off to keep the runs short (its compile costs about as much as the training's).
Cross-process collectives of CPU devices need jaxlib's gloo; where two processes cannot
all-reduce, the tests are skipped, with the probe's error as the reason.

Marked `multiprocess` and left out of the default `python -m pytest` (pytest.ini): beside
another pytest worker on 2 cores, jaxlib 0.7.1's gloo set-up missed its fixed 30 s key-value
deadline (seen once in a CI run here). CI runs them alone, after the suite:
`python -m pytest -m multiprocess -n 0`. A run that a starved machine spoils (a late device
thread at an XLA:CPU rendezvous, gloo's set-up deadline) is tried once more.
"""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import fake_devices

TIMEOUT_S = 600  # per run, every process of it (a busy 2-core machine is slow)
STEPS = 10  # the reference run's; a SIGTERM after step 3 stops the 2 processes before
STOP_BOUND_S = 120  # SIGTERM to one process -> every process has exited
HEARTBEAT_S = 10  # mesh.heartbeat_timeout_s of the SIGKILL test
GLOO_LATE = "Gloo context initialization failed"
RUN = ["launch/train.py", "--config=configs/bandit.py:tiny", "--progress=false",
       "--config.val.before_train=False", "--config.val.test_freq=0",
       "--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.mesh.tensor=1"]
PROBE = """
import sys, jax, jax.numpy as jnp, numpy as np
from jax.experimental import multihost_utils
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                           process_id=int(sys.argv[2]), initialization_timeout=60)
x = multihost_utils.process_allgather(jnp.full((2,), jax.process_index() + 1.0), tiled=True)
assert np.allclose(x, [1, 1, 2, 2]), x
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_processes(args: list[str], count: int, devices: int, tmp_path, name: str):
    """Start `python *args --config.mesh.coordinator_address=... --config.mesh.process_id=I`
    (or PROBE's argv) for I < count, each with `devices` fake CPU devices and unbuffered output
    in files (no pipe to fill; readable while they run). Returns [(Popen, (out, err))]."""
    port, started = free_port(), []
    for i in range(count):
        extra = ([f"--config.mesh.coordinator_address=127.0.0.1:{port}",
                  f"--config.mesh.num_processes={count}", f"--config.mesh.process_id={i}"]
                 if args[0].endswith(".py") else [f"127.0.0.1:{port}", str(i)])
        paths = (tmp_path / f"{name}{i}.out", tmp_path / f"{name}{i}.err")
        with open(paths[0], "w") as out, open(paths[1], "w") as err:  # the child keeps its copy
            started.append((subprocess.Popen(
                [sys.executable, *args, *extra], cwd=fake_devices.ROOT,
                env={**fake_devices.env(devices), "PYTHONUNBUFFERED": "1"}, stdout=out,
                stderr=err), paths))
    return started


def wait_processes(started, timeout: float = TIMEOUT_S, stop_on_failure: bool = True):
    """Wait until all end (or, with stop_on_failure, one fails: the others would wait for it
    at a collective) or time's up; kill what is left. Returns their results."""
    procs = [p for p, _ in started]
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or (
                    stop_on_failure and any(c not in (None, 0) for c in codes)):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, out.read_text(), err.read_text())
            for p, (out, err) in started]


def run_processes(args: list[str], count: int, devices: int, tmp_path, name: str,
                  timeout: float = TIMEOUT_S) -> list[subprocess.CompletedProcess]:
    return wait_processes(start_processes(args, count, devices, tmp_path, name), timeout)


def wait_for(started, text: str, timeout: float = TIMEOUT_S) -> None:
    """Until process 0's output shows `text`; fails if a process ends first."""
    out = started[0][1][0]
    deadline = time.monotonic() + timeout
    while text not in out.read_text():
        ended = [p.poll() for p, _ in started]
        if time.monotonic() > deadline or any(c is not None for c in ended):
            results = wait_processes(started, timeout=0)
            raise AssertionError(f"no {text!r} from process 0 (exits {ended})\n"
                                 + failure(results, everyone=True))
        time.sleep(0.1)


def starved(results) -> bool:
    """A run lost to the machine's load rather than to the code: a device thread late at an
    XLA:CPU rendezvous, or gloo's fixed 30 s set-up deadline missed while a process compiled."""
    return any(fake_devices.ABORTED_AT_RENDEZVOUS in r.stderr or GLOO_LATE in r.stderr
               for r in results)


def failure(results, everyone: bool = False) -> str:
    return "\n".join(f"process {i}: exit {r.returncode}\n{r.stderr[-3000:]}"
                     for i, r in enumerate(results) if everyone or r.returncode != 0)


@pytest.fixture(scope="module")
def cross_process_collectives(tmp_path_factory):
    """Skip unless two processes can join and all-gather over CPU devices here."""
    results = run_processes(["-c", PROBE], 2, 1, tmp_path_factory.mktemp("probe"), "probe",
                            timeout=120)
    if any(r.returncode != 0 for r in results):
        lines = [ln for r in results for ln in r.stderr.splitlines() if ln.strip()]
        pytest.skip(f"two JAX processes cannot all-gather over CPU devices with this jax/jaxlib: "
                    f"{lines[-1] if lines else 'no output'}")


def metrics(workdir) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def compared(row: dict) -> dict:
    """A metrics row without wall-clock numbers (timings, throughput)."""
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/"))
            or k == "perf/update_context"}


def same_metrics(want: list[dict], got: list[dict], rel_tol: float = 1e-4) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for w, g in zip(want, got):
        w, g = compared(w), compared(g)
        assert sorted(g) == sorted(w)
        bad = {k: (w[k], g[k]) for k in w
               if not math.isclose(w[k], g[k], rel_tol=rel_tol, abs_tol=1e-6)}
        assert not bad, f"step {w['step']}: {bad}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cross_process_collectives):
    """The uninterrupted run: 1 process x 4 devices, STEPS steps, a checkpoint every 2."""
    workdir = tmp_path_factory.mktemp("ref") / "run"
    ref = fake_devices.run([*RUN, f"--config.trainer.total_steps={STEPS}",
                            "--config.trainer.save_freq=2",
                            f"--config.trainer.keep_checkpoints={STEPS}", f"--workdir={workdir}"], n=4, timeout=TIMEOUT_S)
    assert ref.returncode == 0, ref.stderr[-3000:]
    rows = metrics(workdir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert any(r["actor/grad_norm"] > 0 for r in rows)  # updates that moved the weights
    return workdir


@pytest.mark.multiprocess
def test_two_processes_train_as_one(tmp_path, reference):
    for attempt in range(2):  # as fake_devices.run: once more after a starved set-up
        multi = tmp_path / f"multi{attempt}"
        results = run_processes([*RUN, "--config.trainer.total_steps=4",
                                 "--config.trainer.save_freq=0", f"--workdir={multi}"],
                                2, 2, tmp_path, f"train{attempt}-")
        if not starved(results):
            break
    assert all(r.returncode == 0 for r in results), failure(results)
    # process 0 alone prints the run and the steps (and writes the metrics)
    assert "x4 (mesh data x fsdp x tensor = 1 x 4 x 1)" in results[0].stdout
    assert "step 4/4" in results[0].stdout
    assert "step " not in results[1].stdout and "workdir:" not in results[1].stdout
    same_metrics(metrics(reference)[:4], metrics(multi))

    # the checkpoint both processes wrote (their own shards) holds the same weights. Adam moves
    # a weight by about lr = 1e-2 per step whatever its gradient's size, so where a gradient is
    # near 0 the all-reduce's order (gloo across processes vs. in one) shows up as up to ~3e-5
    # (seen); a lost or misplaced shard would be off by the weights' own scale (~1e-2)
    import jax

    from starpo import experiment

    _, a, step_a = experiment.load_run(str(reference), step=4)
    _, b, step_b = experiment.load_run(str(multi))
    assert step_a == step_b == 4
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=0, atol=2e-4)


def resumable_copy(reference, to, step: int):
    """A copy of the reference run as if it had stopped after its checkpoint at `step`."""
    shutil.copytree(reference, to)
    for d in (to / "checkpoints").iterdir():
        if d.name.isdigit() and int(d.name) > step:
            shutil.rmtree(d)
    return to


@pytest.mark.multiprocess
def test_sigterm_to_one_process_stops_all_and_resumes_across_layouts(tmp_path, reference):
    """1 process's checkpoint at step 2 resumes in 2 processes; SIGTERM to process 1 alone
    stops both at the same step with a checkpoint (exit status 75, one line); that checkpoint
    resumes in 1 process; every step's metrics equal the uninterrupted run's."""
    for attempt in range(2):
        workdir = resumable_copy(reference, tmp_path / f"run{attempt}", 2)
        started = start_processes([*RUN, f"--config.trainer.total_steps={STEPS}",
                                   "--config.trainer.save_freq=0", f"--workdir={workdir}"],
                                  2, 2, tmp_path, f"term{attempt}-")
        try:
            wait_for(started, f"step 3/{STEPS}")
        except AssertionError:
            results = wait_processes(started, timeout=0)
            if attempt == 0 and starved(results):
                continue
            raise
        started[1][0].send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        results = wait_processes(started, timeout=STOP_BOUND_S, stop_on_failure=False)
        took = time.monotonic() - t0
        break
    print(f"SIGTERM to process 1: both exited {took:.1f} s later")
    assert [r.returncode for r in results] == [75, 75], failure(results, everyone=True)
    assert took < STOP_BOUND_S
    assert "resuming" in results[0].stdout and "from step 2" in results[0].stdout
    assert "SIGTERM: finishing this step" in results[1].stderr
    last = results[0].stderr.strip().splitlines()[-1]
    stopped = int(last.split("checkpoint saved at step ")[1].split()[0])
    assert last == (f"stopped on request (on process 1): checkpoint saved at step {stopped} of "
                    f"{STEPS}; the same command resumes the run"), last
    assert 3 <= stopped < STEPS  # the steps after SIGTERM: those until the next boundary
    from starpo import checkpoint

    assert checkpoint.read_meta(workdir / "checkpoints")["step"] == stopped
    same_metrics(metrics(reference)[:stopped], metrics(workdir), rel_tol=1e-3)

    rest = fake_devices.run([*RUN, f"--config.trainer.total_steps={STEPS}",
                             f"--workdir={workdir}"], n=4, timeout=TIMEOUT_S)
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert f"resuming {workdir} from step {stopped}" in rest.stdout
    # steps 3.. follow weights that went through gloo's all-reduce (another summation order
    # than one process's: ~3e-5 apart, see above); the fast-falling entropy of this policy
    # carries that to 1.4e-4 (relative) by step 10 (seen). A lost step, a wrong restore or
    # another seed stream is off by far more (success, score: whole episodes)
    same_metrics(metrics(reference), metrics(workdir), rel_tol=1e-3)


@pytest.mark.multiprocess
def test_killed_process_stops_the_others(tmp_path, cross_process_collectives):
    """SIGKILL to process 1 mid-run: process 0 exits with status 3 and a one-line error naming
    process 1 within mesh.heartbeat_timeout_s (plus the watch's period), instead of waiting in
    a collective for good or failing with gloo's "Connection reset by peer" (both seen)."""
    for attempt in range(2):
        started = start_processes([*RUN, "--config.trainer.total_steps=1000",
                                   "--config.trainer.save_freq=0",
                                   f"--config.mesh.heartbeat_timeout_s={HEARTBEAT_S}",
                                   f"--workdir={tmp_path / f'run{attempt}'}"],
                                  2, 2, tmp_path, f"kill{attempt}-")
        try:
            wait_for(started, "step 2/1000")
        except AssertionError:
            results = wait_processes(started, timeout=0)
            if attempt == 0 and starved(results):
                continue
            raise
        started[1][0].kill()
        t0 = time.monotonic()
        results = wait_processes(started, timeout=HEARTBEAT_S + 30, stop_on_failure=False)
        took = time.monotonic() - t0
        break
    print(f"SIGKILL to process 1: process 0 exited {took:.1f} s later")
    assert results[1].returncode == -signal.SIGKILL
    assert results[0].returncode == 3, failure(results, everyone=True)
    assert 0.8 * HEARTBEAT_S <= took < HEARTBEAT_S + 30
    last = results[0].stderr.strip().splitlines()[-1]
    assert last.startswith("error: process 1 of 2 is lost: no sign of life for "), last
    assert "mesh.heartbeat_timeout_s=" in last
