"""Choose the tests CI's oldest-pins pass may leave out: those whose every line of the project
is also run by a test that stays.

What that pass proves is that the oldest versions requirements.txt allows install and run the
code: every line the suite reaches, reached once at those versions, under a test that asserts
what it computes. A second test that runs only lines some other test already runs proves
nothing new there, so it is left out, the slowest first. Tests that do their work in a
subprocess (launch commands, fake devices, the package) are invisible to the line record and
always stay, as do the files in ALWAYS. New tests are never on the list, so they run.

    STARPO_COVER_DIR=/tmp/cov STARPO_TEST_PROFILE=/tmp/prof.jsonl \
        python -m pytest -p tests.cover_tests          # the line record and each test's seconds
    python .ci/oldest_selection.py /tmp/cov /tmp/prof.jsonl > .ci/oldest_skip.txt

Needs the `coverage` package (a maintainer's tool; CI only reads the list).
"""

import collections
import glob
import json
import sys

import coverage

# Files whose point is a subprocess or a library boundary the line record cannot see.
ALWAYS = ("tests/test_launch.py", "tests/test_sharding.py", "tests/test_package.py",
          "tests/test_multiprocess.py", "tests/test_requirements.py", "tests/test_smollm2.py",
          "tests/test_checkpoint.py", "tests/test_weights.py", "tests/test_tokenizer.py")
# The `learning` run: the pass leaves it out by its marker, so its lines must come from others.
NEVER = ("tests/test_training_frozenlake.py",)


def lines_by_test(cover_dir: str) -> dict[str, set]:
    tests = collections.defaultdict(set)
    for path in glob.glob(f"{cover_dir}/cov.*"):
        data = coverage.CoverageData(basename=path)
        data.read()
        for name in data.measured_files():
            for line, contexts in data.contexts_by_lineno(name).items():
                for c in contexts:
                    if c:
                        tests[c].add((name, line))
    return tests


def main(cover_dir: str, profile: str) -> None:
    seconds = {}
    for row in map(json.loads, open(profile)):
        seconds[row["test"]] = row["seconds"]
    tests = lines_by_test(cover_dir)
    for t in [t for t in seconds if t.startswith(NEVER)]:  # the pass leaves them out anyway
        seconds.pop(t)
        tests.pop(t, None)
    kept = {t for t in seconds if t.split("::")[0] in ALWAYS or t not in tests}
    covered = set().union(*(tests[t] for t in kept if t in tests))
    # the cheapest cover of what is left: tests by new lines per second, best first
    todo = {t: tests[t] - covered for t in tests if t not in kept}
    while True:
        todo = {t: s - covered for t, s in todo.items() if s - covered}
        if not todo:
            break
        best = max(todo, key=lambda t: len(todo[t]) / max(seconds.get(t, 1.0), 0.05))
        kept.add(best)
        covered |= todo.pop(best)
    skipped = sorted(t for t in seconds if t not in kept)
    saved = sum(seconds[t] for t in skipped)
    print(f"# {len(skipped)} of {len(seconds)} tests, {saved:.0f} of "
          f"{sum(seconds.values()):.0f} worker-seconds: every line they run, another test runs"
          f" (.ci/oldest_selection.py)")
    print("\n".join(skipped))


if __name__ == "__main__":
    main(*sys.argv[1:3])
