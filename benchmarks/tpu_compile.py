"""The TPU table of docs/gpu_tpu.md: the runs users would start on a TPU, compiled for their
slices on this machine (no TPU; needs `pip install -r requirements-tpu.txt`).

  JAX_PLATFORMS=cpu python -m benchmarks.tpu_compile                 # every row, kept
  JAX_PLATFORMS=cpu python -m benchmarks.tpu_compile --rows=colab-v5e --out=/tmp/tpu

Each row is one `launch/plan.py --topology` command, run as a user would; its JSON (a line a
program: compile seconds, XLA's bytes per chip, the memory plan's, HBM, the compiler's estimate)
is kept under `--out` with the command, date, commit, host CPU and versions, and the table
printed from the kept files. Compiles take minutes a row on a 2-core CPU (Qwen2.5-0.5B's
FrozenLake run on a v5e 2x2: 8 min).
"""

import datetime
import json
import os
import platform
import subprocess
import sys
import time

from starpo.cli import ArgParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (name, config, model shape, topology, overrides)
ROWS = (
    ("colab-v5e", "configs/frozenlake.py:gpu", "smollm2-135m", "v5e:1x1", ()),
    ("colab-v6e", "configs/frozenlake.py:gpu", "smollm2-135m", "v6e:1x1", ()),
    ("lake-0.5b-v5e-4", "configs/frozenlake.py", "qwen2.5-0.5b", "v5e:2x2", ()),
    ("lake-0.5b-v4-8", "configs/frozenlake.py", "qwen2.5-0.5b", "v4:2x2x1", ()),
    ("sokoban-0.5b-v5e-4", "configs/sokoban.py", "qwen2.5-0.5b", "v5e:2x2", ()),
    ("lake-3b-v5e-8", "configs/frozenlake.py", "qwen2.5-3b", "v5e:2x4", ()),
    ("lake-7b-lora-v5e-8", "configs/frozenlake.py:lora", "qwen2.5-7b", "v5e:2x4", ()),
    ("lake-3b-v5e-256", "configs/frozenlake.py", "qwen2.5-3b", "v5e:16x16", ()),
    # a v4-128 is 64 chips (128 TensorCores, two a chip)
    ("lake-3b-v4-128", "configs/frozenlake.py", "qwen2.5-3b", "v4:4x4x4", ()),
    # the families TPU users bring now (Gemma 3: sliding-window layers, whose cache holds the
    # whole context so far; Qwen3: 8 kv heads of 128, 9x Qwen2.5-0.5B's cache per token)
    ("lake-gemma3-1b-v5e-8", "configs/frozenlake.py", "gemma3-1b", "v5e:2x4", ()),
    ("lake-qwen3-0.6b-v5e-16", "configs/frozenlake.py", "qwen3-0.6b", "v5e:4x4", ()),
)


def versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("jax", "jaxlib", "libtpu", "flax"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def commit() -> str:
    """HEAD's short hash, with "-dirty" where tracked files (but the kept results, which
    each row rewrites) differ from it."""
    p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                       text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":(exclude)results"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return (p.stdout.strip() or "unknown") + ("-dirty" if dirty else "")


def run_row(name, config, model, topo, overrides, out_dir) -> dict:
    cmd = [sys.executable, "launch/plan.py", f"--config={config}", f"--models={model}",
           f"--topology={topo}", *overrides]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    print(f"{name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    record = {
        "row": name, "command": "python " + " ".join(cmd[1:]), "config": config,
        "model": model, "topology": topo, "returncode": p.returncode,
        "wall_s": round(time.perf_counter() - t0, 1),
        "date": datetime.date.today().isoformat(), "commit": commit(),
        "host": f"{cpu_name()}, {os.cpu_count()} cores (compile only: no TPU)",
        "versions": versions(),
        "programs": next((json.loads(line) for line in reversed(p.stdout.splitlines())
                          if line.startswith("[")), []),
        "error": next((line for line in p.stderr.splitlines() if line.startswith("error: ")),
                      None),
    }
    if p.returncode not in (0, 2):  # a crash, not a one-line error: keep what it printed last
        record["stderr_tail"] = p.stderr.splitlines()[-30:]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


def table(records) -> str:
    lines = ["| run | slice | program | compile s | XLA GiB / chip | plan GiB | HBM GiB | "
             "compiler's estimate s |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        if not r["programs"]:
            lines.append(f"| {r['row']} | {r['topology']} | {r['error'] or 'failed'} "
                         "| | | | | |")
        for p in r["programs"]:
            est = p["compiler_estimate_s"]
            xla = f"{p['xla_gib_per_chip']:.2f}"
            if p.get("xla_refused"):  # XLA compiled nothing: what it said does not fit
                xla = f"does not fit ({p['xla_refused']})"
            lines.append(f"| {r['row']} ({r['model']}) | {r['topology']} | {p['program']} | "
                         f"{p['compile_s']:.0f} | {xla} | "
                         f"{p['plan_gib_per_chip']:.2f} | {p['hbm_gib']:.0f} | "
                         f"{'none' if est is None else f'{est:.3g}'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = ArgParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "tpu_compile"))
    parser.add_argument("--print_only", action="store_true",
                        help="print the table from the kept files, compile nothing")
    args = parser.parse_args(argv)
    names = [n for n in args.rows.split(",") if n] or [r[0] for r in ROWS]
    unknown = sorted(set(names) - {r[0] for r in ROWS})
    if unknown:
        parser.error(f"unknown rows {', '.join(unknown)} (rows: {', '.join(r[0] for r in ROWS)})")
    records = []
    for row in ROWS:
        if row[0] not in names:
            continue
        path = os.path.join(args.out, f"{row[0]}.json")
        if args.print_only:
            if os.path.isfile(path):
                with open(path) as f:
                    records.append(json.load(f))
            continue
        records.append(run_row(*row, args.out))
    print(table(records))


if __name__ == "__main__":
    main()
