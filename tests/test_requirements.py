"""Every third-party module the code imports is a declared requirement.

A package that only arrives as another package's dependency (jinja2 came with torch, absl with
ml-collections) works on the machine that happens to have it and breaks a fresh install. This
reads every `import` in the repository (module level and inside functions) and checks that each
top-level module outside the standard library and the repository's own packages belongs to a
distribution named in `requirements.txt`, or, for the optional cross-check tests and comparison
benchmarks, in `requirements-crosscheck.txt`, or, for the notebook's tooling and the curve
plotting script, in `requirements-notebook.txt`. The installable package (pyproject.toml) declares
the same requirements with the same bounds.
"""

import ast
import fnmatch
import functools
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOCAL = {"starpo", "envs", "launch", "configs", "tests", "benchmarks", "experiments"}
# Modules that are not installed in every environment the suite runs in (the cross-check extras
# are absent from the newcomer's venv), so their distribution cannot be looked up: import name ->
# distribution name, checked against the optional requirements file.
KNOWN = {"torch": "torch", "accelerate": "accelerate", "gymnasium": "gymnasium",
         "gym_sokoban": "gym-sokoban", "matplotlib": "matplotlib", "coverage": "coverage"}
OPTIONAL = ("requirements-crosscheck.txt", "requirements-notebook.txt")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_lines(path: pathlib.Path) -> list[str]:
    """The requirement specifiers of a requirements file, comments and options dropped."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def declared(path: pathlib.Path) -> set[str]:
    return {normalise(re.match(r"[A-Za-z0-9_.\-]+", line).group(0))
            for line in requirement_lines(path)}


@functools.cache
def imported_modules() -> dict[str, set[str]]:
    """Top-level module -> files importing it, for every absolute import in the repository."""
    found: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or "site-packages" in rel.parts:
            continue
        siblings = {p.stem for p in path.parent.glob("*.py")}  # benchmarks import each other
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in LOCAL or top in siblings:
                    continue
                found.setdefault(top, set()).add(str(rel))
    return found


@functools.cache
def installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distribution_of(module: str) -> str | None:
    """The normalised name of the distribution that provides `module`, or None."""
    if module in KNOWN:
        return KNOWN[module]
    dists = installed().get(module)
    return normalise(dists[0]) if dists else None


def test_every_imported_module_is_a_declared_requirement():
    required = declared(ROOT / "requirements.txt")
    optional = set().union(*(declared(ROOT / name) for name in OPTIONAL))
    problems = []
    for module, files in sorted(imported_modules().items()):
        dist = distribution_of(module)
        where = ", ".join(sorted(files)[:3])
        if dist is None:
            problems.append(f"{module} (imported by {where}) is not installed and not a known "
                            "optional module: declare it")
        elif dist not in required | optional:
            problems.append(f"{module} (distribution {dist}, imported by {where}) is not in "
                            f"requirements.txt or {' / '.join(OPTIONAL)}")
    assert not problems, "\n".join(problems)


def test_optional_modules_are_only_imported_where_they_may_be_missing():
    """The runtime code (starpo/, envs/, launch/, configs/) imports only requirements.txt."""
    required = declared(ROOT / "requirements.txt")
    runtime = {"starpo", "envs", "launch", "configs"}
    for module, files in imported_modules().items():
        dist = distribution_of(module)
        if dist is not None and dist not in required:
            used = sorted(f for f in files if pathlib.Path(f).parts[0] in runtime)
            assert not used, f"{module} is optional but imported by runtime code: {used}"


def test_the_check_sees_a_missing_requirement(tmp_path):
    """The pieces the check rests on: the scan finds imports inside functions, a module maps to
    its distribution's name (absl -> absl-py), and requirement lines are read by name."""
    assert "jinja2" in imported_modules()  # imported inside a function in starpo/dialogue.py
    assert "absl" in imported_modules()
    assert distribution_of("absl") == "absl-py"
    (tmp_path / "r.txt").write_text("jax[cpu]>=0.7  # comment\nml-collections>=1.0,<2\n")
    assert declared(tmp_path / "r.txt") == {"jax", "ml-collections"}


def spaced(spec: str) -> str:
    """A requirement specifier with its spaces dropped, for comparing two spellings."""
    return spec.replace(" ", "")


def test_the_package_declares_requirements_txt():
    """pyproject.toml's dependencies plus its `test` extra are requirements.txt, bounds and all
    (installing the package or the requirements file gives the same versions); its `notebook`
    extra is requirements-notebook.txt; the GPU/TPU extras are jax's, with jax's bounds."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    required = [spaced(s) for s in requirement_lines(ROOT / "requirements.txt")]
    assert sorted(map(spaced, project["dependencies"] + extras["test"])) == sorted(required)
    assert sorted(map(spaced, extras["notebook"])) == sorted(
        spaced(s) for s in requirement_lines(ROOT / "requirements-notebook.txt"))
    jax = next(s for s in required if s.startswith("jax["))
    bounds = jax[jax.index("]") + 1:]
    assert extras["cuda"] == [f"jax[cuda12]{bounds}"] and extras["tpu"] == [f"jax[tpu]{bounds}"]
    assert extras["cuda13"] == [f"jax[cuda13]{bounds}"]
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    # what the entry points import, their subpackages (starpo.update) too, and nothing else
    wanted = {".".join(p.parent.relative_to(ROOT).parts)
              for top in ("starpo", "envs", "configs", "launch")
              for p in (ROOT / top).rglob("__init__.py")}
    assert "starpo.update" in wanted
    # setuptools' `find` keeps the packages whose names match an `include` pattern (fnmatch)
    assert {p for p in wanted if any(fnmatch.fnmatchcase(p, pat) for pat in include)} == wanted


def test_every_command_is_a_launcher():
    """Each `starpo-NAME` command is `launch/NAME.py`'s `cli`, the function its `__main__` runs
    (so the command and `python launch/NAME.py` take the same flags)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    names = {p.stem for p in (ROOT / "launch").glob("*.py")} - {"__init__", "common", "_checkout"}
    assert set(scripts) == {f"starpo-{n}" for n in names}
    for command, target in scripts.items():
        module, _, function = target.partition(":")
        name = command.removeprefix("starpo-")
        assert (module, function) == (f"launch.{name}", "cli"), command
        source = (ROOT / "launch" / f"{name}.py").read_text()
        tree = ast.parse(source)
        assert any(isinstance(n, ast.FunctionDef) and n.name == "cli" for n in tree.body), command
        assert source.rstrip().endswith('if __name__ == "__main__":\n    cli()'), command
