"""The ways in: launchers run as files from a checkout (from any directory) or as modules, no
`sys.path` changes but the one in launch/_checkout.py, and `--config` values that name the
`configs` package's files work from outside the checkout (what the installed commands rely on).
(Installing the package and running its commands from outside the checkout: .ci/run.)"""

import os
import pathlib
import re
import subprocess
import sys

import configs
from launch import common

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = pathlib.Path(configs.__file__).resolve().parent
PLAN = ["--config=configs/frozenlake.py:tiny", "--models=smollm2-135m", "--devices=1"]


def test_only_one_place_changes_sys_path():
    """`git grep sys.path.insert` finds nothing; no code or notebook edits `sys.path` but the
    launchers' bootstrap (reading it is fine)."""
    edits = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend|remove)|\[[^\]]*\]\s*=|\s*[+]?=)")
    found = []
    for path in [*ROOT.rglob("*.py"), *ROOT.rglob("*.ipynb")]:
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or rel.parts[0] in ("build", "dist") or \
                "site-packages" in rel.parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if "sys.path.insert" in line or edits.search(line):
                found.append(f"{rel}:{i}")
    assert [f for f in found if not f.startswith(("launch/_checkout.py:",
                                                  "tests/test_package.py:"))] == []
    assert any(f.startswith("launch/_checkout.py:") for f in found)  # the check sees an edit


def test_no_file_cites_one_outside_the_repository():
    """The tracked files name no file outside the checkout: the reference's facts the code
    relies on are stated in docs/reference.md, which the citations point to."""
    outside = re.compile(r"REFERENCE\.md|ragen-golden|\.\./shared|/work/shared")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                           text=True).stdout.split()
    if not files:  # not a git checkout (an unpacked archive): every text file
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()
                 and not p.relative_to(ROOT).parts[0].startswith(".")]
    found = []
    for rel in files:
        if rel == "tests/test_package.py":
            continue
        try:
            text = (ROOT / rel).read_text()
        except (UnicodeDecodeError, OSError):
            continue
        found += [f"{rel}:{i}" for i, line in enumerate(text.splitlines(), 1)
                  if outside.search(line)]
    assert found == []
    assert "## 4. Knobs and defaults" in (ROOT / "docs" / "reference.md").read_text()


def run(args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_a_launcher_runs_as_a_file_from_another_directory(tmp_path):
    """`python <checkout>/launch/plan.py` from elsewhere: the checkout's packages are imported
    (the bootstrap puts its root first, not launch/) and the README's `--config=configs/...`
    resolves to the checkout's configs package."""
    p = run([str(ROOT / "launch" / "plan.py"), *PLAN], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert '"model": "smollm2-135m"' in p.stdout.splitlines()[-1]
    probe = ("import runpy, sys; sys.argv = ['x']; "
             f"runpy.run_path({str(ROOT / 'launch' / '_checkout.py')!r}); "
             "print(sys.path[0])")
    # as Python starts a script: its folder first; the bootstrap swaps it for the root
    p = run(["-c", f"import sys; sys.path.insert(0, {str(ROOT / 'launch')!r}); {probe}"],
            tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == str(ROOT), p.stderr


def test_a_launcher_runs_as_a_module():
    p = run(["-m", "launch.plan", *PLAN], ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    p = run(["-m", "launch.plan", "--config=configs/no_such.py"], ROOT)
    assert p.returncode == 2 and p.stderr.strip().startswith("error: config file"), p.stderr


def test_config_paths_fall_back_to_the_configs_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    packaged = str(CONFIGS / "bandit.py")
    assert common.packaged_config("configs/bandit.py:tiny") == packaged + ":tiny"
    assert common.packaged_config("bandit.py") == packaged
    assert common.packaged_config("configs/no_such.py:tiny") == "configs/no_such.py:tiny"
    assert common.packaged_config("elsewhere/bandit.py") == "elsewhere/bandit.py"
    # a file that exists from the current directory is what it names
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "bandit.py").write_text("")
    assert common.packaged_config("configs/bandit.py:tiny") == "configs/bandit.py:tiny"
    assert common.with_packaged_config(
        ["prog", "--config=frozenlake.py:tiny", "--config", "sokoban.py", "--", "--config=x.py"]
    ) == ["prog", f"--config={CONFIGS / 'frozenlake.py'}:tiny", "--config",
          str(CONFIGS / "sokoban.py"), "--", "--config=x.py"]


def test_a_packaged_config_parses_from_another_directory(tmp_path, monkeypatch):
    """The whole flag parse (`common.parse_flags`, as `starpo-train` runs it) with a bare name."""
    from absl import flags

    monkeypatch.chdir(tmp_path)
    argv = ["prog", "--config=frozenlake.py:tiny", "--config.trainer.total_steps=3"]
    values = flags.FlagValues()
    holder = common.define_config("config", flag_values=values, sys_argv=argv)
    common.parse_flags(argv, values, holder, check_config=True)
    assert holder.value.env.name == "FrozenLake" and holder.value.trainer.total_steps == 3
    path, _, variant = values["config"].config_filename.partition(":")
    assert os.path.samefile(path, CONFIGS / "frozenlake.py") and variant == "tiny"


def test_a_relative_workdir_saves_checkpoints(tmp_path, monkeypatch):
    """The default workdir (docs/training.md) is relative (runs/<config>); orbax refuses relative paths,
    so the first checkpoint of such a run failed."""
    import numpy as np

    from starpo import checkpoint

    monkeypatch.chdir(tmp_path)
    ckpt = checkpoint.Checkpointer("runs/x/checkpoints")
    ckpt.save(1, {"w": np.arange(3.0, dtype=np.float32)}, {"note": "relative"})
    assert (tmp_path / "runs" / "x" / "checkpoints" / "1").is_dir()
    again = checkpoint.Checkpointer("runs/x/checkpoints", read_only=True)
    assert again.latest_step() == 1


def _starpo_imports() -> dict:
    """module -> the starpo modules its top-level statements import (a subpackage such as
    `starpo/update/` as one)."""
    import ast

    out = {}
    packages = sorted(p.parent for p in (ROOT / "starpo").glob("*/__init__.py"))
    for path in sorted((ROOT / "starpo").glob("*.py")) + packages:
        name = path.stem if path.suffix else path.name
        if name == "__init__":
            continue
        files = sorted(path.glob("*.py")) if path.is_dir() else [path]
        deps = set()
        for f in files:
            for node in ast.parse(f.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.ImportFrom) and node.module == "starpo":
                    deps |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("starpo."):
                    deps.add(node.module.split(".")[1])
                elif isinstance(node, ast.Import):
                    deps |= {a.name.split(".")[1] for a in node.names
                             if a.name.startswith("starpo.")}
        out[name] = deps - {name}
    return out


def test_the_layout_page_lists_every_module_and_its_floor():
    """docs/layout.md's floors are the code's: a module's floor is one above the highest of the
    modules it imports (0: none), and every module has a line in the page's module list."""
    imports = _starpo_imports()
    floors = {}

    def floor(name, seen=()):
        assert name not in seen, f"an import circle: {seen + (name,)}"
        if name not in floors:
            below = [floor(d, seen + (name,)) for d in imports[name] if d in imports]
            floors[name] = 1 + max(below) if below else 0
        return floors[name]

    for name in imports:
        floor(name)
    page = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    block = page.split("```\nfloor ")[1].split("```")[0]
    documented, current = [], None
    for line in ("floor " + block).splitlines():
        words = line.split()
        if words[:1] == ["floor"]:
            current, words = int(words[1]), words[2:]
        documented += [(w, current) for w in words]
    assert sorted(documented) == sorted(floors.items())
    for name in imports:
        assert f"\nstarpo/{name}.py " in page or f"\nstarpo/{name}/ " in page, name


def test_an_env_is_its_own_file():
    """Every registered env states its own text and budgets (`text`, `budgets`); the shared text
    layer (envs/text.py) names no env, so a new env needs no edit there."""
    import ast

    import envs

    tree = ast.parse((ROOT / "envs" / "text.py").read_text(encoding="utf-8"))
    imported = [a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names] + [n.module for n in ast.walk(tree)
                                      if isinstance(n, ast.ImportFrom) and n.module]
    assert not any(name.split(".")[0] == "envs" or name in envs.NAMES for name in imported)
    for name in envs.NAMES:
        env = envs.make(name)
        per_turn, per_traj = env.budgets
        text = env.text(per_turn, per_traj)
        assert (text.max_actions_per_turn, text.max_actions_per_traj) == (per_turn, per_traj)
