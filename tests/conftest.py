"""Shared fixtures: tiny configs with random Hugging Face-layout weights, and the real model."""

import atexit
import json
import os
import shutil
import tempfile
import time

import numpy as np
import pytest

# Tests never touch the user's model cache unless they ask for the real model (`smollm2`).
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# On a GPU, JAX takes 75% of its memory when it starts; each pytest-xdist worker is a process of
# its own, so the second would find too little. Set before anything imports jax (pytest loads
# this file first in every worker); it changes nothing on CPU. (A TPU admits one process: run
# the suite there with `-n 0`.)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The tests' float32 means IEEE float32: they compare float32 programs with float64 NumPy
# references and with each other to float32 rounding. An NVIDIA GPU multiplies float32 matrices
# at reduced (TF32-like) precision by default, ~1e-3 relative, which no such tolerance admits;
# XLA:CPU always multiplies float32 exactly, so this changes nothing on CPU. bfloat16 programs
# are unaffected (their operands are bfloat16 at every precision). Read when jax is imported.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# The suite compiles far more than it runs (tiny models run in milliseconds and compile in
# seconds: 56% of the workers' time is XLA compiling, `tests/profile_report.py`), so XLA skips
# its expensive optimisation passes (LLVM at -O0): the compile-heavy files take 15% less time
# (test_sampler + test_update, alone: 79 -> 67 s); the programs compute the same functions, to
# float rounding.
# Inherited by the commands the tests start. The `learning` run is the exception: it runs for
# minutes and would take twice as long (88 -> 161 s), so its command compiles as a user's does
# (tests/test_training_frozenlake.py).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# XLA:CPU's newer (MLIR) fusion emitters compile a fusion several times slower than its older
# loop emitters do, for kernels of the same speed at the tests' sizes, so the suite turns them
# off (its time and the figures: docs/install.md, "Tests"). Not for users' runs: fully optimised,
# the older emitters compile slower. Only with jaxlib 0.10.x: with 0.7.1 they also change what
# XLA reserves (the rollout's cache is no longer copied), which tests/test_memory.py measures
# as a user's run has it (CI's oldest-pins pass sets them itself for every other file: .ci/run),
# and an XLA_FLAGS entry an XLA does not know aborts the process (later versions are unchecked).
# Never over a setting of the user's own. Inherited by the commands
# the tests start (tests/fake_devices.py keeps it too).
FAST_CPU_COMPILE = "--xla_cpu_use_fusion_emitters=false"


def _jaxlib_version() -> tuple:
    from importlib import metadata

    try:
        return tuple(int(x) for x in metadata.version("jaxlib").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return ()


if ((0, 10) <= _jaxlib_version() < (0, 11)
        and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_CPU_COMPILE}".strip()
# XLA:GPU may add in a different order run to run (atomics in scatters, such as an embedding's
# gradient, and in some reductions), so one program run twice can differ in its last bits and
# a sampled token then differ too. Tests that resume a run and compare it with a straight one,
# or train with the state offloaded against without, mean bit-equal programs, so the suite asks
# XLA for its deterministic GPU kernels (a user who wants that too sets the same flag; it
# changes nothing on a CPU). Known to the XLA of every jaxlib from 0.7 to 0.10; a newer one is
# asked first (an XLA_FLAGS entry an XLA does not know aborts the process), once per run.
DETERMINISTIC_GPU = "--xla_gpu_exclude_nondeterministic_ops=true"
if ("xla_gpu_exclude_nondeterministic_ops" not in os.environ.get("XLA_FLAGS", "")
        and not os.environ.get("STARPO_TEST_XLA_PROBED")):
    from tests.fake_devices import xla_knows

    os.environ["STARPO_TEST_XLA_PROBED"] = "1"  # the workers inherit the answer
    if (0, 7) <= _jaxlib_version() < (0, 11) or xla_knows(DETERMINISTIC_GPU):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DETERMINISTIC_GPU}".strip()
# One persistent compilation cache for the run, in a fresh directory: the controller makes it
# before pytest-xdist starts its workers, which inherit the variable (so do the subprocesses the
# tests start, `starpo.harness.enable_compilation_cache` included). A program compiled by one
# worker is then read from disk by the others instead of compiled again (few recur across
# files today: 50 of 1,321 compiles in the training-heavy files). Fresh per run, so the suite's
# time never depends on an earlier run; a JAX_COMPILATION_CACHE_DIR of the user's own is used.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="starpo-test-jax-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

# Config numbers in the vocabulary of tests/numpy_reference.py.
LLAMA_LIKE = dict(vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=48,
                  theta=10000.0, eps=1e-5, tied=True, bias=False, scaling=None)
QWEN_LIKE = dict(vocab=96, hidden=48, layers=3, heads=6, kv_heads=2, head_dim=8, mlp=64,
                 theta=500000.0, eps=1e-6, tied=False, bias=True,
                 scaling=(8.0, 1.0, 4.0, 64))
# Qwen3's differences: q/k norms, no bias, a head dim that is not hidden / heads
QWEN3_LIKE = dict(vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=48,
                  theta=1000000.0, eps=1e-6, tied=True, bias=False, scaling=None, qk_norm=True)


def random_hf_tensors(c, seed=0):
    """Random tensors with Hugging Face names and [out, in] layouts for config numbers `c`."""
    rng = np.random.default_rng(seed)
    D, F, V, H, K, E = c["hidden"], c["mlp"], c["vocab"], c["heads"], c["kv_heads"], c["head_dim"]

    def w(*shape, scale=0.2):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"model.embed_tokens.weight": w(V, D, scale=1.0),
         "model.norm.weight": 1 + w(D, scale=0.1)}
    if not c["tied"]:
        t["lm_head.weight"] = w(V, D)
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + w(D, scale=0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + w(D, scale=0.1)
        t[p + "self_attn.q_proj.weight"] = w(H * E, D)
        t[p + "self_attn.k_proj.weight"] = w(K * E, D)
        t[p + "self_attn.v_proj.weight"] = w(K * E, D)
        t[p + "self_attn.o_proj.weight"] = w(D, H * E)
        if c.get("qk_norm"):
            t[p + "self_attn.q_norm.weight"] = 1 + w(E, scale=0.3)
            t[p + "self_attn.k_norm.weight"] = 1 + w(E, scale=0.3)
        if c["bias"]:
            t[p + "self_attn.q_proj.bias"] = w(H * E)
            t[p + "self_attn.k_proj.bias"] = w(K * E)
            t[p + "self_attn.v_proj.bias"] = w(K * E)
        t[p + "mlp.gate_proj.weight"] = w(F, D)
        t[p + "mlp.up_proj.weight"] = w(F, D)
        t[p + "mlp.down_proj.weight"] = w(D, F)
    return t


def hf_config_json(c):
    """A config.json dict for config numbers `c` (written independently of starpo)."""
    model_type = "qwen3" if c.get("qk_norm") else "qwen2" if c["bias"] else "llama"
    out = {
        "architectures": [{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "llama": "LlamaForCausalLM"}[model_type]],
        "model_type": model_type,
        "vocab_size": c["vocab"], "hidden_size": c["hidden"], "num_hidden_layers": c["layers"],
        "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"],
        "intermediate_size": c["mlp"], "rope_theta": c["theta"], "rms_norm_eps": c["eps"],
        "tie_word_embeddings": c["tied"], "max_position_embeddings": 256, "hidden_act": "silu",
    }
    if c["hidden"] // c["heads"] != c["head_dim"]:
        out["head_dim"] = c["head_dim"]
    if c["scaling"]:
        f, lo, hi, old = c["scaling"]
        out["rope_scaling"] = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo,
                               "high_freq_factor": hi, "original_max_position_embeddings": old}
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from starpo.tokenizer import Tokenizer

    return Tokenizer.tiny()


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model (fetched once into the user cache); skipped if unreachable."""
    from starpo import weights

    try:
        return weights.load_model("smollm2-135m-instruct")
    except weights.LoadError as e:
        pytest.skip(f"embedded model unavailable: {e}")


# The files start longest first (each file runs in one worker: `--dist=loadfile`), so that the
# short files fill the workers' ends instead of one long file running alone at the end: a
# simulation of pytest-xdist's schedule with the seconds each file took (below, the README's
# command on a 2-core AMD EPYC, Zen 5) left one of the two workers 55 s longer than the other
# with the earlier order (a few slow files first, then the rest alphabetically, the 48 s
# tests/test_update.py third from last), and <1 s with this one. A file not listed comes after
# these in collection order: list a new file here where it takes more than a few seconds.
FILES_LONGEST_FIRST = (
    "test_training_frozenlake.py",  # 74 s (one training run, compiled as a user's is)
    "test_sft.py", "test_update.py", "test_training.py",  # 58, 48, 42
    "test_memory.py", "test_sudoku.py", "test_lora.py", "test_reproduce.py",  # 31-32
    "test_sharding.py", "test_sampler.py", "test_launch.py", "test_context_window.py",  # 24-27
    "test_model.py", "test_benchmarks.py", "test_solvers.py", "test_configs.py",  # 12-22
    "test_rollout_mixed.py", "test_chunks.py", "test_smollm2.py", "test_countdown.py")  # 8-10


def pytest_runtest_logreport(report):
    """With STARPO_TEST_FAILURES=FILE, each failure's report is appended to FILE as it happens
    (pytest-xdist prints them only at the end, which a run cut off by a time limit, a GPU lease's
    say, never reaches)."""
    path = os.environ.get("STARPO_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = os.path.basename(str(item.fspath))
        return (FILES_LONGEST_FIRST.index(name) if name in FILES_LONGEST_FIRST
                else len(FILES_LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order inside a file is kept


# ----------------------------------------------------------------------------- time profile
# STARPO_TEST_PROFILE=FILE: each test's seconds of tracing, lowering and XLA compiling (JAX's
# own monitoring events, in this process; a test's subprocesses are not counted) appended to
# FILE as one JSON line per test, for `python -m tests.profile_report FILE`.
_PROFILE = os.environ.get("STARPO_TEST_PROFILE")
_COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                   "/jax/core/compile/backend_compile_duration": "compile"}
_spent: dict = {}
_names: dict = {}  # compiled program name -> seconds, in the running test

if _PROFILE:
    def _on_duration(event, seconds, **kwargs):
        if event in _COMPILE_EVENTS:
            _spent[_COMPILE_EVENTS[event]] = _spent.get(_COMPILE_EVENTS[event], 0.0) + seconds
            if event.endswith("backend_compile_duration"):
                _spent["programs"] = _spent.get("programs", 0) + 1
                name = kwargs.get("fun_name", "?")
                _names[name] = _names.get(name, 0.0) + seconds

    def _on_event(event, **kwargs):
        if event.startswith("/jax/compilation_cache/cache_"):  # cache_hits, cache_misses
            name = event.rsplit("/", 1)[1]
            _spent[name] = _spent.get(name, 0) + 1

    import jax.monitoring  # noqa: E402  (only when profiling; after the environment above)

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _spent.clear()
        _names.clear()
        start = time.perf_counter()
        yield
        row = dict(test=item.nodeid, seconds=round(time.perf_counter() - start, 3),
                   **{k: round(v, 3) for k, v in _spent.items()},
                   slowest_programs=dict(sorted(_names.items(), key=lambda kv: -kv[1])[:8]))
        with open(_PROFILE, "a") as f:
            f.write(json.dumps(row) + "\n")
