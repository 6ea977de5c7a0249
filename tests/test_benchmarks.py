"""The update benchmark runs on whatever device JAX uses and states what it measured."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def profiles_rank_kernels(on_cpu: bool = True) -> bool:
    """Whether a jax.profiler trace holds per-kernel events here: not with jax 0.7.1's XLA:CPU,
    which traces no per-op events (there a profile's ranking is empty)."""
    import jax

    return not on_cpu or tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 10)


def test_update_benchmark_reports_params_device_dtype_and_memory(tmp_path):
    """A cheap variant of docs/benchmarks.md's 0.5B-shape command (a `random:` model of 2 layers):
    the JSON line has the model's exact parameter count, the device, the dtype, peak memory
    labelled by where it was measured, and MFU against a stated peak; with --profile, one more
    step traced: its kernels' time by kind, adding up to the busy time, and the matmuls' share."""
    spec = ("random:layers=2,hidden=64,heads=4,kv_heads=2,head_dim=16,mlp=96,vocab=1000,"
            "qkv_bias=1,tie=0")
    p = subprocess.run([sys.executable, "-m", "benchmarks.update",
                        f"--model={spec}", "--batch=1", "--seq_len=32", "--steps=1",
                        "--torch=no", f"--profile={tmp_path / 'prof'}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    d, f, v = 64, 96, 1000
    per_layer = d * (64 + 2 * 32) + 64 * d + 3 * d * f + 2 * d + (64 + 2 * 32)
    assert out["params"] == v * d + 2 * per_layer + d + d * v
    assert out["device"] and out["dtype"] in ("float32", "bfloat16")
    assert out["memory"] in ("device", "host_rss") and out["peak_memory_gb"] > 0
    assert out["mfu"] > 0 and out["peak_source"]
    prof = out["profile"]
    assert "error" not in prof and prof["wall_s"] > 0, prof
    if profiles_rank_kernels(out["device"] == "cpu"):
        assert prof["top"] and sum(prof["by_kind"].values()) > 0
        assert abs(sum(prof["by_kind"].values()) - prof["busy_s"]) < 1e-5
        assert 0 <= out["matmul_share"] <= 1


def test_train_step_benchmark_runs_its_phases_ahead_of_time():
    """benchmarks/train_step.py on Bandit's tiny run: each phase compiled ahead of time and run
    on the same data (the update's program is called with the whole TrainState, as the update
    is), and the last line one JSON object with every phase's seconds and the memory plan.
    With the state offloaded while sampling (as `training.fit_memory` sets it where the plan
    needs it), its round trip is a phase of its own and the JSON says what was fitted."""
    p = subprocess.run([sys.executable, "-m", "benchmarks.train_step",
                        "--config=configs/bandit.py:tiny", "--config.trainer.fast_compile=True",
                        "--config.trainer.offload_state=True", "--capacity_gb=24"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(out["phase_s"]) == {"rollout", "old_logprobs", "adv_filter", "ppo_updates",
                                   "offload"}
    assert out["fit"] == {"capacity_gb": 24.0, "offload_state": True, "decode_windows": 1}
    assert out["iteration_s"] >= out["phase_s"]["offload"] >= 0  # ms on a CPU: rounds to 0
    assert set(out["compile_s"]) == {"rollout", "old_logprobs", "prepare", "update"}
    assert out["episodes"] == 64 and out["iteration_s"] > 0
    assert set(out["memory_gb"]["plan"]) == {"rollout", "validation", "update"}
    # XLA's reservation for each compiled program (what a measured peak above the plan is read
    # against), and the device's peak once it was compiled (None: a CPU keeps no statistics)
    xla = out["memory_gb"]["xla_program"]
    assert set(xla) == set(out["compile_s"]) and all(v >= 0 for v in xla.values())
    assert xla["update"] > 0 and xla["rollout"] > 0
    assert set(out["memory_gb"]["peak_after_compile"]) == set(out["compile_s"])
    assert set(out["memory_gb"]["in_use_before_compile"]) == set(out["compile_s"])
    # the plan is checked before any phase runs, as a run checks it (after them, on a CPU, the
    # process's own buffers would count against the host memory left)
    lines = p.stderr.splitlines()
    first_phase = next(i for i, line in enumerate(lines) if line.startswith("rollout: "))
    assert any(line.startswith("memory plan: update") for line in lines[:first_phase])


def test_decode_bound_is_the_bytes_a_step_reads_over_the_bandwidth():
    """The rollout's memory-bandwidth bound, by hand: weights once per step plus each row's
    filled cache (2 x layers x kv heads x head dim values per slot)."""
    from benchmarks import sampler
    from starpo.model import ModelConfig

    cfg = ModelConfig(vocab_size=10, hidden_size=8, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=2, intermediate_size=16)
    b = sampler.decode_bound(cfg, rows=5, steps=7, mean_fill=11.0, dtype="bfloat16",
                             cache_dtype="float32")
    per_step = cfg.num_params * 2 + 5 * 11 * (2 * 3 * 2 * 2 * 4)
    assert b["bytes_per_step"] == per_step and b["decode_steps"] == 7
    if b["bandwidth_tb_s"] is None:  # CPU: no bound
        assert b["bound_s"] is None
    else:
        assert b["bound_s"] == round(7 * per_step / (b["bandwidth_tb_s"] * 1e12), 4)


def test_gpu_report_reads_pytest_and_benchmark_output():
    """benchmarks/gpu_report.py's parsing: pytest's summary (failing ids too), a benchmark's last
    JSON line, and each target's verdict, "unmeasured" where a figure is missing."""
    from benchmarks import gpu_report as g

    log = ("FAILED tests/test_model.py::test_a - AssertionError\nERROR tests/test_x.py::b\n"
           "= 2 failed, 35 passed, 3 skipped, 1 error in 80.2s =\n")
    counts = g.pytest_counts(log)
    assert (counts["failed"], counts["passed"], counts["skipped"], counts["error"]) == (2, 35, 3, 1)
    assert counts["failing"] == ["tests/test_model.py::test_a", "tests/test_x.py::b"]
    # a -v run with xdist stopped by its limit: no summary, the ids and counts from its lines
    cut = ("[gw1] [  3%] PASSED tests/test_lora.py::test_a \n"
           "[gw0] [  6%] FAILED tests/test_memory.py::test_b[tiny] \n"
           "[gw1] [  9%] SKIPPED tests/test_model.py::test_c \n"
           "[gw0] [ 12%] PASSED tests/test_model.py::test_d[x-1] \n")
    assert g.pytest_counts(cut) == {"passed": 2, "failed": 1, "skipped": 1,
                                    "failing": ["tests/test_memory.py::test_b[tiny]"]}
    assert g.last_json('{"a": 1}\nnoise\n{"a": 2}\n{broken\n') == {"a": 2}
    report = {"steps": {"tests": counts, "iteration": {"result": {
        "iteration_s": 3.5, "memory_gb": {"plan": {"rollout": 12.0, "update": 21.0},
                                          "peak_after": {"rollout": None, "update": 9.0}}}}}}
    head = g.headline(report)
    assert (head["iteration_s"], head["plan_max_gb"], head["peak_gb"]) == (3.5, 21.0, 9.0)
    v = g.verdicts(head)
    assert v["iteration_s"].startswith("met") and v["plan_max_gb"].startswith("missed")
    assert v["tests_failed"].startswith("missed") and v["update_mfu"] == "unmeasured"
    assert head["sampler_tokens_per_s_by_xla_flags"] is None  # the xla step not run
    report["steps"]["xla"] = {"variants": [
        {"xla_flags": "", "tokens_per_s": 100.0},
        {"xla_flags": "--xla_gpu_enable_triton_gemm=false", "tokens_per_s": None}]}
    assert g.headline(report)["sampler_tokens_per_s_by_xla_flags"] == {
        "default": 100.0, "--xla_gpu_enable_triton_gemm=false": None}
    # the decode kernel's step: the sampler with model.decode_attention=pallas
    from types import SimpleNamespace

    args = SimpleNamespace(quick=True, model=g.QWEN05, out="out", tests="", workers=1,
                           tests_s=1.0, step_s=1.0, torch_variants="")
    assert "--decode_attention=pallas" in g.steps(args)["decode_kernel"][1]
    report["steps"]["decode_kernel"] = {"result": {"tokens_per_s": 150.0}}
    assert g.headline(report)["sampler_tokens_per_s_decode_kernel"] == 150.0
    # fitted to a 24 GB card, the iteration's plan and peaks are the ones held to 20 GB
    fit = {"capacity_gb": 24.0, "offload_state": True, "decode_windows": 4}
    report["steps"]["card24"] = {"result": {
        "iteration_s": 3.9, "fit": fit,
        "memory_gb": {"plan": {"rollout": 16.2, "update": 19.8},
                      "peak_after": {"rollout": 15.0, "update": 19.5},
                      "peak_after_compile": {"rollout": 14.0, "old_logprobs": None,
                                             "update": 19.5}}}}
    head = g.headline(report)
    assert (head["plan_max_gb"], head["peak_gb"], head["memory_measured_as"]) == (
        19.8, 19.5, "card24")
    assert head["peak_once_compiled_gb"] == 19.5  # the update's peak came while compiling
    assert head["card24_fit"] == fit and head["iteration_s"] == 3.5
    assert g.verdicts(head)["plan_max_gb"].startswith("met")
    # in a preallocated pool of 20 GB of an H200's 143,771 MiB (150.8 GB): the pool's figures come first
    env = g.pool_env(20.0, 143_771 * 2**20)
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) * 143_771 * 2**20 == pytest.approx(
        20e9, rel=1e-5)
    assert "no NVIDIA GPU" in g.pool_env(20.0, None)
    assert "more than the GPU's 16.0 GB" in g.pool_env(20.0, 16 * 10**9)
    report["steps"]["pool"] = {"rc": 0, "pool_gb": 20.0, "result": {
        "iteration_s": 4.2, "memory_gb": {"plan": {"rollout": 15.1, "update": 19.4},
                                          "peak_after": {"rollout": 17.0, "update": 19.9}}}}
    head = g.headline(report)
    assert (head["memory_measured_as"], head["peak_gb"], head["plan_max_gb"]) == (
        "pool", 19.9, 19.4)
    assert (head["pool_gb"], head["pool_rc"], head["pool_iteration_s"]) == (20.0, 0, 4.2)


def test_gpu_report_says_why_the_pool_step_did_not_run(tmp_path, monkeypatch, capsys):
    """Without an NVIDIA GPU's memory total, the pool step is recorded as not run, with why,
    and the report is still written."""
    from benchmarks import gpu_report as g

    monkeypatch.setattr(g, "gpu_total_bytes", lambda: None)
    g.main(["--quick", "--steps=pool", "--pool_gb=20", f"--out={tmp_path}"])
    with open(tmp_path / "report.json") as f:
        report = json.load(f)
    assert report["steps"]["pool"] == {"rc": "not run", "pool_gb": 20.0,
                                       "why": "no NVIDIA GPU (nvidia-smi) to take a memory pool of"}
    assert (report["headline"]["pool_rc"], report["headline"]["peak_gb"]) == ("not run", None)
    assert "pool" in capsys.readouterr().err


# A hand-written optimised module: the entry runs a while loop whose body holds a layer's
# fusion, a sampling fusion, a fusion without a source name, a copy, a host callback and
# instructions that launch nothing; a comment inside a header's tuple type, as XLA prints them.
HLO = """HloModule jit_run_turn, is_scheduled=true

%fused_layer (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p0), metadata={op_name="jit(run_turn)/while/body/closed_call/Block/mlp/neg"}
}

%body (arg: (s32[], f32[4], /*index=2*/f32[4])) -> (s32[], f32[4], /*index=2*/f32[4]) {
  %arg = (s32[], f32[4]{0}, f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[4]{0} get-tuple-element(%arg), index=1
  %one = s32[] constant(1)
  %layer = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_layer, metadata={op_name="jit(run_turn)/while/body/closed_call/Block/mlp/neg"}
  %draw = f32[4]{0} fusion(%layer), kind=kLoop, calls=%fused_layer, metadata={op_name="jit(run_turn)/while/body/jit(_uniform)/add"}
  %plain = f32[4]{0} fusion(%draw), kind=kLoop, calls=%fused_layer
  %c = f32[4]{0} copy(%plain)
  %cb = f32[4]{0} custom-call(%c), custom_call_target="xla_python_cpu_callback"
  %next = s32[] add(%i, %one), metadata={op_name="jit(run_turn)/while/body/add"}
  ROOT %t = (s32[], f32[4]{0}, f32[4]{0}) tuple(%next, %cb, %c)
}

%cond (arg.1: (s32[], f32[4], /*index=2*/f32[4])) -> pred[] {
  %arg.1 = (s32[], f32[4]{0}, f32[4]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%arg.1), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x.0: f32[4]) -> f32[4] {
  %x.0 = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}, f32[4]{0}) tuple(%zero, %x.0, %x.0)
  %w = (s32[], f32[4]{0}, /*index=2*/f32[4]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_decode_step_counts_what_a_loop_body_launches(tmp_path):
    """benchmarks/decode_step.py's reading of a while body, against a hand count of HLO above:
    5 launches (3 fusions, the copy, the callback: not the parameter, the tuple elements, the
    constant or the tuple) plus the counter's add, 2 host round trips (the condition, the
    callback), the launches by source op; then on a real compiled sampler turn (one layer)."""
    from benchmarks import decode_step

    (loop,) = decode_step.loops(HLO)
    assert (loop["body"], loop["condition"]) == ("body", "cond")
    assert loop["launches"] == 6 and loop["instructions"] == 11
    assert loop["host_round_trips"] == 2
    assert loop["by_source"] == {"layers": 1, "jit(_uniform)": 1, "(unnamed)": 3, "add": 1}
    assert loop["custom_calls"] == {"xla_python_cpu_callback": 1}

    spec = "random:layers=1,hidden=32,heads=2,kv_heads=1,head_dim=16,mlp=64,vocab=400"
    p = subprocess.run([sys.executable, "-m", "benchmarks.decode_step", f"--model={spec}",
                        "--batch=2", "--prompt_len=8", "--new_tokens=4",
                        f"--profile={tmp_path / 'prof'}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["layers"] == 1 and out["host_round_trips_per_step"] == 1
    # the layer's own work is there, and so is the sampling around it
    assert out["launches_per_layer"] > 0 and out["launches_outside_layers"] > 0
    assert out["launches_per_step"] == out["launches_per_layer"] + out["launches_outside_layers"]
    # the traced run: on a CPU the XLA threads' events stand in for a device's kernels
    prof = out["profile"]
    on_cpu = out["backend"] == "cpu"
    assert prof["source"] == ("cpu threads (proxy)" if on_cpu else "device")
    assert prof["wall_s"] > 0
    if profiles_rank_kernels(on_cpu):
        assert prof["loop_kernels"] > 0 and prof["per_step_launches"] > 0 and prof["top"]


def test_kernel_profile_ranks_device_kernels_from_a_trace():
    """decode_step.kernel_profile on a hand-made perfetto trace: only the device process's
    stream events count (not the host's, not a line derived from them), kernels run at least
    once a step are the loop's, and the
    figures by hand: busy 4x10 + 4x5 + 100 us = 160 us of a 1 ms wall, a step 15 us and 2
    launches (4 steps)."""
    from benchmarks import decode_step

    def ev(pid, name, dur):
        return {"ph": "X", "pid": pid, "tid": 1, "name": name, "ts": 0, "dur": dur}

    trace = {"traceEvents": [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 1, "name": "thread_name", "args": {"name": "Stream #7"}},
        # a line derived from the kernels: not counted again
        {"ph": "M", "pid": 2, "tid": 9, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "X", "pid": 2, "tid": 9, "name": "fusion.3", "ts": 0, "dur": 40},
        *[ev(2, "gemm_fusion_dot_3", 10) for _ in range(4)],
        *[ev(2, "input_reduce_fusion_1", 5) for _ in range(4)],
        ev(2, "prefill_fusion", 100), ev(1, "cuLaunchKernel", 500),
        {"ph": "i", "pid": 2, "name": "marker"}]}
    p = decode_step.kernel_profile(trace, steps=4, wall_s=0.001)
    assert p["source"] == "device" and p["kernels"] == 3 and p["loop_kernels"] == 2
    assert p["busy_s"] == 0.00016 and p["busy_fraction"] == 0.16
    assert p["per_step_s"] == 1.5e-05 and p["per_step_launches"] == 2.0
    assert [k["name"] for k in p["top"]] == ["prefill_fusion", "gemm_fusion_dot_3",
                                             "input_reduce_fusion_1"]
    assert p["top"][1] == {"name": "gemm_fusion_dot_3", "total_s": 4e-05, "count": 4,
                           "mean_us": 10.0}
    assert p["by_kind"] == {"elementwise": 1e-04, "matmul": 4e-05, "reduction": 2e-05}


def test_kernel_kinds_of_xla_gpu_and_library_kernel_names():
    """decode_step.kernel_kind on kernel names as XLA:GPU, cuBLAS(Lt), cuDNN and NCCL write
    them (cuDNN's attention runs WGMMA instructions too: attention, not matmul)."""
    from benchmarks.decode_step import kernel_kind

    kinds = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "matmul",
        "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NNT": "matmul",
        "gemm_fusion_dot_12": "matmul",
        "cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3": "attention",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "collective",
        "dynamic_update_slice_fusion_3": "copy", "Memcpy DtoD (Device -> Device)": "copy",
        "wrapped_transpose": "copy", "input_reduce_fusion_7": "reduction",
        "triton_softmax_fusion_2": "reduction", "loop_add_fusion_4": "elementwise",
        "wrapped_convert": "elementwise", "rng_bit_generator": "other",
    }
    assert {name: kernel_kind(name) for name in kinds} == kinds


@pytest.mark.parametrize("module, argv, words", [
    ("update", ["--model=tiny", "--batch=0"], "--batch must be >= 1, got 0"),
    ("update", ["--model=tiny", "--micro_batch=3"], "--micro_batch 3 does not divide --batch 8"),
    ("update", ["--model=nope"], "--model: unknown model 'nope'"),
    ("update", ["--dtype=float8"], "--dtype must be one of auto, float32, bfloat16"),
    ("update", ["--batch=abc"], "argument --batch: invalid int value: 'abc'"),
    ("sampler", ["--model=tiny", "--new_tokens=0"], "--new_tokens must be >= 1, got 0"),
    ("sampler", ["--cache_dtype=float16"], "--cache_dtype must be one of float32, bfloat16"),
    ("gpu_report", ["--steps="], "--steps names no step"),
    ("gpu_report", ["--step_s=-1"], "--step_s must be > 0, got -1.0"),
    ("keep_evaluations", [], "the following arguments are required: lease"),
])
def test_benchmark_command_lines_refuse_bad_input_in_one_line(monkeypatch, capsys, module,
                                                               argv, words):
    """Every benchmark's bad argument: `error: ...` in one line, exit status 2, before any
    work (`launch.common.ArgParser`; nothing is loaded or run in these cases)."""
    import importlib

    main = importlib.import_module(f"benchmarks.{module}").main
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert words in err[0], err
