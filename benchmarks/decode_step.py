"""What one decode step is made of, from the compiled program: the work a device launches per
sampled token, and how often the host has to wait for the device.

  python -m benchmarks.decode_step --model=random:layers=24,hidden=896,...  # any model spec

Compiles one sampler turn (`sampler.run_turn`, a fresh prompt of `prompt_len` tokens then up to
`new_tokens` decode steps) for the default backend, without running it, and reads XLA's
optimised HLO: every `while` loop's body, its top-level instructions counted by opcode. The
decode loop is the body that runs the model (the most instructions). Per decode step:
- `launches`: top-level instructions that do work (fusions, library calls such as matmuls,
  copies, in-place updates, sorts, ...; not tuples, parameters, constants or bitcasts). On a
  GPU each is one kernel launch or library call; XLA groups runs of them into CUDA graphs
  (command buffers; on by default on GPUs), which the HLO shows only where an XLA version forms
  them as HLO calls (`command_buffers`); jax 0.11's XLA forms them later, from the compiled
  thunks, so there 0 does not mean none: compare the sampler's speed with
  `XLA_FLAGS=--xla_gpu_enable_command_buffer=` (off). On a CPU, one compiled kernel or runtime
  call.
- `host_round_trips`: 1 per iteration of a `while` whose condition the device computes: on a
  GPU the host reads the predicate back before it launches the next step, so the launch queue
  drains once per step; plus any host transfer or callback inside the body.
Launch-bound time per step is about launches x the device's per-launch cost (~2-5 us on an
H100 without CUDA graphs), against the bandwidth bound of reading the weights and the cache
(`benchmarks.sampler`'s `decode_bound`). With `--profile=DIR` it also runs the turn and
ranks the device's kernels by time from a jax.profiler trace (`kernel_profile`): the decode
step's device time and how busy the device was. Prints one JSON object.

Run from the repository root: `python -m` puts it on the import path.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.sampler import device_kind, prompts
from starpo import precision, sampler, weights

# instructions that launch nothing: they name, pack or reinterpret buffers
FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all",
        "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain"}
HOST = {"send", "recv", "send-done", "recv-done", "outfeed", "infeed"}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")


def computations(hlo: str) -> dict[str, list[tuple[str, str]]]:
    """{computation name: [(opcode, rest of the line)]} from an HLO module's text."""
    comps, current = {}, None
    for line in hlo.splitlines():
        line = _COMMENT.sub("", line)
        if current is None:
            m = _HEADER.match(line)
            if m and "=" not in line.split("{")[0]:
                current = m.group(1)
                comps[current] = []
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append((m.group(3), m.group(4)))
    return comps


def loops(hlo: str) -> list[dict]:
    """Every while loop's body: its top-level instructions by opcode, largest body first."""
    comps = computations(hlo)
    out = []
    for name, instrs in comps.items():
        for op, rest in instrs:
            if op != "while":
                continue
            body = re.search(r"body=%?([\w.\-]+)", rest)
            cond = re.search(r"condition=%?([\w.\-]+)", rest)
            if not body or body.group(1) not in comps:
                continue
            ops = collections.Counter(o for o, _ in comps[body.group(1)])
            custom = collections.Counter(
                t.group(1) for o, r in comps[body.group(1)] if o == "custom-call"
                for t in [re.search(r'custom_call_target="([^"]+)"', r)] if t)
            launches = sum(n for o, n in ops.items() if o not in FREE)
            # where each launch comes from, by its source op's name: the transformer layers
            # (`Block`), else the first named step inside the loop (sampling, stop checks, ...)
            where = collections.Counter()
            for o, r in comps[body.group(1)]:
                if o in FREE:
                    continue
                name = re.search(r'op_name="([^"]*)"', r)
                name = name.group(1) if name else ""
                if "/Block" in name:
                    where["layers"] += 1
                else:
                    tail = name.split("while/body/")[-1] if "while/body/" in name else name
                    where[tail.split("/")[0] or "(unnamed)"] += 1
            host = sum(n for o, n in ops.items() if o in HOST) + sum(
                n for t, n in custom.items() if "callback" in t.lower() or "host" in t.lower())
            out.append(dict(body=body.group(1), condition=cond.group(1) if cond else None,
                            instructions=sum(ops.values()), launches=launches,
                            host_round_trips=1 + host,
                            command_buffers=sum(o == "call" and "command_buffer" in r
                                                for o, r in comps[body.group(1)]),
                            by_opcode=dict(ops.most_common()),
                            by_source=dict(where.most_common()),
                            custom_calls=dict(custom.most_common())))
    return sorted(out, key=lambda d: -d["instructions"])


# A kernel's kind from its name, first match wins: cuBLAS / cuBLASLt / CUTLASS kernels and
# XLA's Triton GEMM fusions (`gemm_fusion_dot_*`) are matmuls, cuDNN's fused attention is
# attention, XLA's `input_*` fusions are reductions, its `loop_*` and other fusions elementwise.
# On a CPU (the proxy) the names are the HLO ops' (`dot.3`, `fusion.7`).
KERNEL_KINDS = (
    ("attention", re.compile(r"sdpa|flash|fmha|cudnn", re.I)),
    ("collective", re.compile(r"nccl|all-?reduce|all-?gather|reduce-?scatter|collective", re.I)),
    ("matmul", re.compile(r"gemm|xmma|cutlass|nvjet|wgmma|cublas|matmul|^dot|_dot", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset|dynamic.update.slice|transpose", re.I)),
    ("reduction", re.compile(r"^input_|reduce|softmax|argmax|sort|topk|cumsum", re.I)),
    ("elementwise", re.compile(r"fusion|^loop_|^wrapped_", re.I)),
)


def kernel_kind(name: str) -> str:
    """`KERNEL_KINDS`' kind of a kernel name, else "other"."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def kernel_profile(trace, steps: int, wall_s: float, top: int = 25) -> dict:
    """Device time by kernel from a perfetto trace (jax.profiler's `perfetto_trace.json.gz`) of
    one sampler turn of `steps` decode steps, timed at `wall_s` seconds.

    Device events are the complete events ("ph": "X") of processes whose name is not a host's
    (`/device:GPU:0 ...`), on its CUDA streams' lines where it names them (not the lines derived
    from them, such as "XLA Ops"); XLA:CPU has no device process, so there the XLA threads'
    events stand in, a proxy that counts nested regions twice. A kernel run at least `steps` times is counted as the
    decode loop's (`per_step_s`: their time over `steps`); `busy_fraction` is all device time
    over the wall time: near 1 the kernels themselves are the cost, far below 1 the device
    waits for the host (launches, round trips). `by_kind`: the device seconds by
    `kernel_kind`, largest first."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e.get("pid")] = e.get("args", {}).get("name", "")
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = e.get("args", {}).get("name", "")
    device = {p for p, n in procs.items() if n and not n.startswith("/host")}
    # a GPU's device process also holds lines derived from its kernels ("XLA Modules", "XLA
    # Ops", "Steps", ...): where it has CUDA streams, their events alone are the kernels
    streams = {k for k, n in threads.items() if k[0] in device and n.startswith("Stream")}
    if device:
        def keep(e):
            return e.get("pid") in device and (not streams
                                               or (e.get("pid"), e.get("tid")) in streams)
    else:
        def keep(e):
            return (threads.get((e.get("pid"), e.get("tid")), "").startswith("tf_XLA")
                    and not e["name"].startswith(("end:", "Threadpool", "Slinky",
                                                  "ThunkExecutor", "while")))
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and keep(e):
            total[e["name"]] += float(e.get("dur", 0)) * 1e-6
            count[e["name"]] += 1
    busy = sum(total.values())
    loop = {k for k, n in count.items() if n >= steps}
    kinds = collections.Counter()
    for k, v in total.items():
        kinds[kernel_kind(k)] += v
    return dict(source="device" if device else "cpu threads (proxy)", wall_s=round(wall_s, 6),
                busy_s=round(busy, 6), busy_fraction=round(busy / wall_s, 3) if wall_s else None,
                kernels=len(total), loop_kernels=len(loop),
                per_step_s=round(sum(total[k] for k in loop) / steps, 6),
                per_step_launches=round(sum(count[k] for k in loop) / steps, 1),
                by_kind={k: round(v, 6) for k, v in kinds.most_common()},
                top=[dict(name=k[:120], total_s=round(v, 5), count=count[k],
                          mean_us=round(v / count[k] * 1e6, 2))
                     for k, v in total.most_common(top)])


def traced_profile(run, folder: str, steps: int) -> dict:
    """`kernel_profile` of one call of `run()` (which waits for its results), traced by
    jax.profiler into `folder`; the wall time is the call's alone (not the profiler's start)."""
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        t = time.perf_counter()
        run()
        wall = time.perf_counter() - t
    traces = sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"),
                              recursive=True), key=os.path.getmtime)
    if not traces:
        raise FileNotFoundError(f"jax.profiler wrote no perfetto trace under {folder}")
    with gzip.open(traces[-1], "rt") as f:
        return kernel_profile(json.load(f), steps, wall)


def profile_turn(compiled, params, args, folder: str, steps: int, fresh_state) -> dict:
    """`traced_profile` of one run of the compiled turn, after a warm-up run."""
    def turn():  # a fresh cache each time: the turn donates it
        jax.block_until_ready(compiled(params, fresh_state(), *args))

    turn()
    return traced_profile(turn, folder, steps)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt_len", type=int, default=256)
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", help="decode matmul input dtype")
    p.add_argument("--cache_dtype", default="bfloat16")
    p.add_argument("--hlo_out", default="", help="also write the optimised HLO text here")
    p.add_argument("--profile", default="",
                   help="also run the turn (once to warm up, once traced by jax.profiler into "
                        "this folder) and rank the device's kernels by time")
    a = p.parse_args()

    try:
        m = weights.load_model(a.model)
    except weights.LoadError as e:
        sys.exit(f"error: {e}")
    rows = prompts(m.tokenizer, a.batch, a.prompt_len)
    B, P = rows.shape
    cfg = m.cfg.replace(dtype=a.dtype)
    smp = sampler.Sampler(cfg, a.new_tokens, eos_ids=(), pad_id=m.tokenizer.pad_id,
                          prefill_dtype=precision.compute_bound_dtype())
    state = sampler.init_state(cfg, B, P + a.new_tokens, jnp.dtype(a.cache_dtype))
    args = (jnp.asarray(rows), jnp.ones(rows.shape, bool), jax.random.key(0), jnp.float32(1.0),
            jnp.ones((B,), bool), None)
    t = time.perf_counter()
    compiled = sampler.run_turn.lower(smp, m.params, state, *args, fresh=True).compile()
    compile_s = time.perf_counter() - t
    hlo = compiled.as_text()
    if a.hlo_out:
        with open(a.hlo_out, "w") as f:
            f.write(hlo)
    found = loops(hlo)
    if not found:
        sys.exit("error: no while loop in the compiled turn (is the decode loop unrolled?)")
    step = found[0]
    result = dict(model=a.model, backend=jax.default_backend(), device=device_kind(),
                  jax=jax.__version__, batch=B, prompt_len=P, new_tokens=a.new_tokens,
                  dtype=a.dtype, cache_dtype=a.cache_dtype, layers=cfg.num_layers,
                  compile_s=round(compile_s, 1),
                  launches_per_step=step["launches"],
                  launches_per_layer=round(step["by_source"].get("layers", 0) / cfg.num_layers,
                                           1),
                  launches_outside_layers=step["launches"] - step["by_source"].get("layers", 0),
                  host_round_trips_per_step=step["host_round_trips"],
                  command_buffers_per_step=step["command_buffers"],
                  decode_body=step, other_loops=[
                      {k: d[k] for k in ("body", "instructions", "launches")} for d in found[1:]])
    if a.profile:
        try:
            result["profile"] = profile_turn(compiled, m.params, args, a.profile, a.new_tokens,
                                             lambda: sampler.init_state(
                                                 cfg, B, P + a.new_tokens,
                                                 jnp.dtype(a.cache_dtype)))
        except Exception as e:  # the launch counts above still stand
            result["profile"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    print(f"decode step: {step['launches']} launches ({result['launches_per_layer']} a layer, "
          f"{result['launches_outside_layers']} outside them), {step['host_round_trips']} host "
          f"round trip(s); by source: {dict(list(step['by_source'].items())[:8])}",
          file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
