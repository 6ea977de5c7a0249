"""Which dtype each phase multiplies in, from what the backend (and on CPU, the processor)
multiplies fast. The one place that asks the hardware.

Master weights and matmul accumulation are float32 whatever these choose.
"""

from __future__ import annotations

import contextlib

import jax

_TARGET: list[str] = []  # the platform programs are built for, where not this machine's


def backend() -> str:
    """The platform the programs being built are for: this process's default backend, or the
    one `target` names (a TPU topology compiled ahead of time on this CPU, `starpo/aot.py`)."""
    return _TARGET[-1] if _TARGET else jax.default_backend()


@contextlib.contextmanager
def target(platform: str):
    """Within it, every choice made from the backend (dtypes, kernels, micro-batches) is made as
    for `platform` ("cpu", "gpu" or "tpu"), whatever this machine is."""
    _TARGET.append(platform)
    try:
        yield
    finally:
        _TARGET.pop()


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 natively (x86 AVX512-BF16 or AMX-BF16 on Linux).

    Without it XLA:CPU converts bfloat16 to float32 inside every dot, and bfloat16 matmuls run
    slower than float32 ones (AVX2-only AMD EPYC, 2048^3: 90 vs 122 GFLOP/s).
    `cpuinfo`: the text of /proc/cpuinfo (read here when None; False where it is missing).
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def compute_bound_dtype() -> str:
    """Matmul input dtype for many-row (compute-bound) matmuls on this backend: bfloat16 on
    GPU/TPU and on CPUs that multiply it natively, float32 on other CPUs."""
    return "bfloat16" if backend() != "cpu" or cpu_has_fast_bf16() else "float32"


def phase_dtypes(config) -> dict[str, str]:
    """Matmul input dtypes of each phase: {"decode", "prefill", "update"}. Matmuls accumulate
    in float32 and master weights stay float32 whatever these are.

    `model.dtype` "auto": bfloat16 everywhere on GPU/TPU. On CPU, decode (a few rows per
    matmul, bound by reading the weights) stays float32, because XLA:CPU's bfloat16 dots with
    few rows run 2-4x slower than float32 ones; prefill and the update (hundreds of rows per
    matmul, compute-bound) take `compute_bound_dtype()`: bfloat16 where the CPU multiplies it
    natively (about twice the float32 rate there), float32 elsewhere.
    Any other value is used for every phase.
    """
    d = config.model.dtype
    if d != "auto":
        return dict(decode=d, prefill=d, update=d)
    if backend() != "cpu":
        return dict(decode="bfloat16", prefill="bfloat16", update="bfloat16")
    wide = compute_bound_dtype()
    return dict(decode="float32", prefill=wide, update=wide)
