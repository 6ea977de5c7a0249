"""Subprocesses with N fake CPU devices (XLA makes them only at start-up).

XLA:CPU runs each fake device's part of a program on a thread of its own, and a collective
(an all-reduce over a mesh axis, say) waits at a rendezvous for all its devices' threads. A
thread that arrives too late aborts the whole process. On 2 cores with another pytest worker
compiling beside it, one of 8 device threads can be that late: jaxlib 0.7's limit is a fixed
10 s (seen on this project's CI machine), newer XLA takes the limit as a flag. So the flag is
set where the installed XLA knows it, and a run aborted at a rendezvous is tried once more.
The limit is 180 s, far above any lateness seen: with 600 s the 8-device run once took 715 s
inside the suite (jax 0.10.2, the other worker busy) against 42 s alone, a stall that only a
lost thread explains; 180 s bounds what such a stall costs before the retry.
"""

import functools
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LATE_LIMIT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds=180"
ABORTED_AT_RENDEZVOUS = "Termination timeout for"


@functools.cache
def _xla_knows(flag: str) -> bool:
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, text=True, timeout=120)
    return probe.returncode == 0


def env(n: int = 8) -> dict:
    """os.environ for a CPU-only JAX process with `n` devices (and the repository importable)."""
    flags = f"--xla_force_host_platform_device_count={n}"
    if _xla_knows(LATE_LIMIT_FLAG):
        flags += " " + LATE_LIMIT_FLAG
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)


def run(args: list[str], n: int = 8, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python *args` with `n` fake devices from the repository root; a run that XLA aborted
    at a collective's rendezvous (a device thread starved, not a wrong result) runs again once."""
    for _ in range(2):
        done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env(n), capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode == 0 or ABORTED_AT_RENDEZVOUS not in done.stderr:
            return done
    return done
