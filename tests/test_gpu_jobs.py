"""The GPU lease's job files (benchmarks/gpu_jobs*.txt, run by benchmarks/gpu_lease.sh): a
mistyped command there is found on a GPU machine only, and costs a lease of 15 minutes. Each
command is checked here as far as that can be without a GPU or the runs it reads."""

import glob
import os
import shlex
import subprocess
import sys

import pytest
from absl import flags

from launch import common
from tests.fake_devices import xla_knows
from tests.test_training import ROOT

JOB_FILES = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "gpu_jobs*.txt")))
CONFIG_LAUNCHERS = ("launch/train.py", "launch/sft.py", "benchmarks.train_step")


def job_xla_flags():
    """Each distinct XLA_FLAGS value a job line sets."""
    found = set()
    for path in JOB_FILES:
        with open(path) as f:
            for line in f:
                if line.strip().startswith("#"):
                    continue
                for word in shlex.split(line):
                    if word.startswith("XLA_FLAGS="):
                        found.add(word.removeprefix("XLA_FLAGS="))
    return sorted(found)


def jobs():
    """(file name, the command's words after its environment settings and `timeout N`)."""
    for path in JOB_FILES:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                words = shlex.split(line)
                while "=" in words[0] and not words[0].startswith("-"):
                    words.pop(0)
                if words[0] == "timeout":
                    words = words[2:]
                yield os.path.basename(path), words


JOBS = list(jobs())


def test_the_lanes_exist():
    names = [os.path.basename(p) for p in JOB_FILES]
    assert {"gpu_jobs.txt", "gpu_jobs_sokoban.txt", "gpu_jobs_speed.txt"} <= set(names), names
    assert len(JOBS) >= 8
    with open(os.path.join(ROOT, "benchmarks", "gpu_lease.sh")) as f:
        lease = f.read()
    for name in ("gpu_jobs.txt", "gpu_jobs_sokoban.txt", "gpu_jobs_speed.txt"):
        assert f"benchmarks/{name}" in lease, name  # the lanes a plain `run` starts
    # the earlier leases' evaluations join the reproduction's workdir, which the jobs name
    assert 'for d in results/smollm2_gpu/*/; do' in lease and 'cp -r "$d" "$L/repro/"' in lease
    assert os.path.isdir(os.path.join(ROOT, "results", "smollm2_gpu"))
    assert all("--workdir=/tmp/lease/repro" in " ".join(words)
               for _, words in JOBS if words[1] == "launch/reproduce.py")


def test_the_tests_a_lease_reruns_exist():
    """benchmarks/gpu_tests.txt (LEASE_TESTS_FILE): an id that names no test stops pytest
    before it runs any, so each id's file and test function must be here."""
    with open(os.path.join(ROOT, "benchmarks", "gpu_tests.txt")) as f:
        ids = [x.strip() for x in f if x.strip() and not x.startswith("#")]
    assert ids
    for test_id in ids:
        path, _, name = test_id.partition("::")
        assert name and "[" not in name, test_id  # whole tests, all their cases
        with open(os.path.join(ROOT, path)) as f:
            assert f"\ndef {name}(" in f.read(), test_id


@pytest.mark.parametrize("name,words", JOBS)
def test_each_job_runs_a_program_here_with_config_keys_that_exist(name, words):
    """Its program is in the repository; a launcher's `--config.*` overrides name keys of its
    config with values of their types (parsed as the launcher parses them; the run folders
    the command reads come from earlier jobs, so they are not looked for); a reproduction's
    flags and `--set` keys pass its `--dry_run` (~1 s each); gpu_report's flags and steps
    parse."""
    assert words[0] == "python", (name, words)
    program = words[2] if words[1] == "-m" else words[1]
    args = words[3:] if words[1] == "-m" else words[2:]
    path = (os.path.join(ROOT, *program.split(".")) + ".py") if words[1] == "-m" else (
        os.path.join(ROOT, program))
    assert os.path.isfile(path), (name, program)
    if program in CONFIG_LAUNCHERS:
        argv = [program] + [a for a in args if a.startswith("--config")]
        values = flags.FlagValues()
        config = common.define_config("the config", flag_values=values, sys_argv=argv)
        common.parse_flags(argv, values, config)
        assert values["config"].value is not None
    if program == "benchmarks.gpu_report":  # its flags and step names, nothing run
        from benchmarks import gpu_report

        gpu_report.arguments(args)
    if program == "launch/reproduce.py" and "--print_only" not in args:  # (that runs nothing)
        p = subprocess.run([sys.executable, program, *args, "--dry_run"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (name, p.stderr[-2000:])


@pytest.mark.parametrize("xla_flags", job_xla_flags())
def test_each_jobs_xla_flags_are_known_to_xla(xla_flags):
    """An XLA flag this jaxlib does not know stops the process at its first computation (XLA
    parses every backend's flags, so a GPU flag is checked on a CPU too): a flag that XLA has
    removed would cost a job its lease slot."""
    assert xla_knows(xla_flags), xla_flags


def test_a_leases_evaluations_are_kept_once_and_nothing_else(tmp_path):
    """benchmarks/keep_evaluations.py: from a lease.tgz as `collect` writes it, each run's
    config.json and eval/ JSON go into the kept folder; a run without an evaluation (cut off),
    a run already kept, metrics and logs stay out."""
    import io
    import json
    import tarfile

    from benchmarks import keep_evaluations

    files = {"./repro/sft_Sokoban_seed1/config.json": "{}",
             "./repro/sft_Sokoban_seed1/eval/SimpleSokoban.json": '{"results": {}}',
             "./repro/sft_Sokoban_seed1/metrics.jsonl": "{}\n",
             "./repro/starpo-s_Sokoban_seed1/config.json": "{}",  # cut off: no evaluation
             "./repro/starpo-s_Sokoban_seed1/metrics.jsonl": "{}\n",
             "./repro/sft_Sokoban/config.json": '{"new": 1}',
             "./repro/sft_Sokoban/eval/SimpleSokoban.json": '{"new": 1}',
             "./repro/logs/sft_Sokoban_seed1.sft.log": "log",
             "./lane1_job1.log": "log"}
    tgz = tmp_path / "lease.tgz"
    with tarfile.open(tgz, "w:gz") as archive:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            archive.addfile(info, io.BytesIO(text.encode()))
    kept = tmp_path / "kept"
    (kept / "sft_Sokoban" / "eval").mkdir(parents=True)
    (kept / "sft_Sokoban" / "eval" / "SimpleSokoban.json").write_text('{"old": 1}')
    assert keep_evaluations.keep(str(tgz), str(kept)) == {"kept": ["sft_Sokoban_seed1"],
                                                           "already": ["sft_Sokoban"]}
    assert sorted(str(p.relative_to(kept)) for p in kept.rglob("*") if p.is_file()) == [
        "sft_Sokoban/eval/SimpleSokoban.json", "sft_Sokoban_seed1/config.json",
        "sft_Sokoban_seed1/eval/SimpleSokoban.json"]
    assert json.loads((kept / "sft_Sokoban" / "eval" / "SimpleSokoban.json").read_text()) == {
        "old": 1}
