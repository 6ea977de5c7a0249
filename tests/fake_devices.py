"""Subprocesses with N fake CPU devices (XLA makes them only at start-up).

XLA:CPU runs each fake device's part of a program on a thread of its own, and a collective
(an all-reduce over a mesh axis, say) waits at a rendezvous for all its devices' threads. A
thread that arrives too late aborts the whole process. Now and then a run stalls for good at a
rendezvous, a thread lost rather than late: with a 600 s limit the 8-device run once took 715 s
inside the suite against 42 s alone; with 180 s it cost 263 s of a 686 s suite (this project's
Xeon, jax 0.10.2). It came in none of nine runs alone or beside a busy core there (on the Zen
5 EPYC later, in half of ten runs: below), and most likely
came to the multi-process tests' 4-device reference run, run alone (its set-up 101 s against
18-34 s) with Eigen's intra-op thread pool off (`--xla_cpu_multi_thread_eigen=false`, a cure
for other XLA:CPU wedges), so that flag is not set. What is set, where the
installed XLA knows it (jaxlib 0.7's limit is a fixed 10 s): a 60 s limit, far above any real
lateness of these tiny programs, so a stall costs a minute before the one retry, not three;
and, since its cause was found, a larger thread pool.

What the stall is (a stack dump of a stalled 8-device run, `gdb -p PID -batch -ex "thread
apply all bt"`): XLA:CPU runs each device's part of a program on one pool of threads, as many
as the machine's cores or the devices, whichever is more: 8 here. JAX dispatches ahead of the
devices, and where a device has 32 programs in flight the thread launching its next one
waits; in the dump 4 threads waited so, 4 waited at an all-reduce's rendezvous, and the other
4 devices' parts of that all-reduce had no thread left to run on. A deadlock, not lateness:
more likely the more the process lags behind its own dispatch, so on a busy machine. The pool
takes its size from PJRT_NPROC where set, so these processes get PJRT_NPROC_FAKE threads (a
user's setting kept). `python -m tests.mesh_equivalence` alone, 10 runs with PJRT_NPROC=32
alternated with 10 without, on this project's 2-core Zen 5 EPYC beside a training run at
nice 19: no stall in 20-25 s against 5 stalls of 10 (each aborted after 93-95 s; the others
23-25 s).
"""

import functools
import os
import subprocess
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LATE_LIMIT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds=60"
PJRT_NPROC_FAKE = "32"  # threads of XLA:CPU's pool: the devices' and the launches' waiting
ABORTED_AT_RENDEZVOUS = "Termination timeout for"


@functools.cache
def xla_knows(flag: str) -> bool:
    """Whether this XLA accepts `flag` in XLA_FLAGS (an unknown one aborts the process)."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, text=True, timeout=120)
    return probe.returncode == 0


def env(n: int = 8) -> dict:
    """os.environ for a CPU-only JAX process with `n` devices (and the repository importable)."""
    # the suite's own flags (tests/conftest.py) kept, any device count replaced
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    flags = " ".join(kept + [f"--xla_force_host_platform_device_count={n}"])
    if xla_knows(LATE_LIMIT_FLAG):
        flags += " " + LATE_LIMIT_FLAG
    # the repository first, the caller's path kept (packages installed with --target, say)
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=path,
                PJRT_NPROC=os.environ.get("PJRT_NPROC", PJRT_NPROC_FAKE))


def run(args: list[str], n: int = 8, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python *args` with `n` fake devices from the repository root; a run that XLA aborted
    at a collective's rendezvous (a device thread starved, not a wrong result) runs again once,
    with a warning in pytest's summary that quotes what XLA said (so a log shows each stall)."""
    for attempt in range(2):
        done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env(n), capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode == 0 or ABORTED_AT_RENDEZVOUS not in done.stderr:
            return done
        said = [line for line in done.stderr.splitlines() if ABORTED_AT_RENDEZVOUS in line]
        warnings.warn(f"{n}-device run of {' '.join(args)} aborted at a collective's rendezvous "
                      f"(attempt {attempt + 1} of 2): {said[-1].strip()[-400:]}", stacklevel=2)
    return done
