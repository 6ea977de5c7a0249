"""Where the suite's time goes, per file: `STARPO_TEST_PROFILE=prof.jsonl python -m pytest`,
then `python -m tests.profile_report prof.jsonl` (seconds of wall time in the test's worker,
and of it JAX tracing, lowering and XLA compiling; subprocesses' time is wall time only)."""

import collections
import json
import sys


def main(path: str, top: int = 40) -> None:
    files = collections.defaultdict(lambda: collections.Counter())
    seen = collections.Counter()
    for line in open(path):
        row = json.loads(line)
        seen[row["test"]] += 1
        f = files[row["test"].split("::")[0]]
        f["tests"] += 1
        for k in ("seconds", "trace", "lower", "compile", "programs", "cache_hits"):
            f[k] += row.get(k, 0)
    total = collections.Counter()
    for c in files.values():
        total.update(c)
    print(f"{'file':42s} {'tests':>5s} {'wall s':>8s} {'trace':>7s} {'lower':>7s} "
          f"{'compile':>8s} {'programs':>8s} {'disk hits':>9s}")
    for name, c in sorted(files.items(), key=lambda kv: -kv[1]["seconds"])[:top]:
        print(f"{name:42s} {c['tests']:5d} {c['seconds']:8.1f} {c['trace']:7.1f} "
              f"{c['lower']:7.1f} {c['compile']:8.1f} {c['programs']:8d} {c['cache_hits']:9d}")
    print(f"{'all':42s} {total['tests']:5d} {total['seconds']:8.1f} {total['trace']:7.1f} "
          f"{total['lower']:7.1f} {total['compile']:8.1f} {total['programs']:8d} "
          f"{total['cache_hits']:9d}")
    runs = max(seen.values(), default=0)
    if runs > 1:  # the profile appends: a file kept from an earlier run is summed in
        print(f"note: {path} holds up to {runs} rows a test (the profile appends: it spans "
              f"several runs, summed above); remove it before a run to see one")


if __name__ == "__main__":
    main(*sys.argv[1:2])
