"""Keep a GPU lease's evaluations in the repository: each run's config.json and eval/*.json
from the reproduction's workdir in a lease's `lease.tgz` (`benchmarks/gpu_lease.sh collect`,
where it is `repro/`), into results/smollm2_gpu/, which `launch/reproduce.py --print_only` reads
and `benchmarks/gpu_lease.sh run` copies into the next lease's workdir.

  python -m benchmarks.keep_evaluations /path/to/lease.tgz [--into=results/smollm2_gpu]

A run already kept is left as it is (its evaluations are the ones the README's figures were
read from), and so is a run with no evaluation yet (its training was cut off). Prints what it
kept, then one JSON line.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tarfile

from starpo import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# repro/<run>/config.json and repro/<run>/eval/<tags>.json (a leading ./ as tar writes it)
MEMBER = re.compile(r"^(?:\./)?repro/([^/]+)/(config\.json|eval/[^/]+\.json)$")


def runs_in(archive: tarfile.TarFile) -> dict[str, dict[str, tarfile.TarInfo]]:
    """{run: {path inside the run: member}} of the runs that have at least one evaluation."""
    runs: dict[str, dict[str, tarfile.TarInfo]] = {}
    for member in archive.getmembers():
        m = MEMBER.match(member.name)
        if m and member.isfile():
            runs.setdefault(m.group(1), {})[m.group(2)] = member
    return {run: files for run, files in runs.items()
            if any(p.startswith("eval/") for p in files)}


def keep(tgz: str, into: str) -> dict:
    """Copy the lease's runs that `into` lacks; -> {"kept": [...], "already": [...]}."""
    kept, already = [], []
    with tarfile.open(tgz, "r:gz") as archive:
        for run, files in sorted(runs_in(archive).items()):
            target = os.path.join(into, run)
            if os.path.exists(target):
                already.append(run)
                continue
            for path, member in files.items():
                os.makedirs(os.path.dirname(os.path.join(target, path)), exist_ok=True)
                with archive.extractfile(member) as src, open(os.path.join(target, path),
                                                              "wb") as dst:
                    dst.write(src.read())
            kept.append(run)
    return {"kept": kept, "already": already}


def main(argv=None):
    p = cli.ArgParser(description=__doc__.split("\n\n")[0])
    p.add_argument("lease", help="a lease's lease.tgz")
    p.add_argument("--into", default=os.path.join(ROOT, "results", "smollm2_gpu"),
                   help="the kept evaluations' folder")
    a = p.parse_args(argv)
    if not os.path.isfile(a.lease):
        sys.exit(f"error: {a.lease}: no such file")
    try:
        out = keep(a.lease, a.into)
    except (tarfile.TarError, OSError) as e:
        sys.exit(f"error: {a.lease}: not a readable lease archive ({e})")
    if not out["kept"] and not out["already"]:
        print(f"note: {a.lease} holds no run with evaluations (nothing kept)", file=sys.stderr)
    for run in out["kept"]:
        print(f"kept {run}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
