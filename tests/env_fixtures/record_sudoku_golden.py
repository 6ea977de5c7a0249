"""Records tests/env_fixtures/sudoku_golden.json from RAGEN-2's own Sudoku env.

    python tests/env_fixtures/record_sudoku_golden.py /path/to/RAGEN-checkout > sudoku_golden.json

The checkout is github.com/mll-lab-nu/RAGEN at 20daedc47558e000f7de912b060646bf2e8026bd; only
`ragen/env/sudoku/` is imported, with gymnasium and `ragen.env.base` stubbed (the env uses
gym.Env.reset(seed) and BaseLanguageBasedEnv.__init__ only). Not run by the tests.
"""

import json
import sys
import types

import numpy as np

root = sys.argv[1]
gym = types.ModuleType("gymnasium")
gym.Env = type("Env", (), {"reset": lambda self, seed=None: None})
sys.modules["gymnasium"] = gym
for name in ("ragen", "ragen.env"):
    mod = types.ModuleType(name)
    mod.__path__ = [root + "/" + name.replace(".", "/")]
    sys.modules[name] = mod
base = types.ModuleType("ragen.env.base")
base.BaseLanguageBasedEnv = type("BaseLanguageBasedEnv", (), {"__init__": lambda self: None})
sys.modules["ragen.env.base"] = base

from ragen.env.sudoku import SudokuEnv, SudokuEnvConfig  # noqa: E402
from ragen.env.sudoku.utils import get_valid_numbers  # noqa: E402


def config(difficulty="easy", max_steps=81):
    return SudokuEnvConfig(grid_size=9, difficulty=difficulty, render_format="with_feedback",
                           show_conflicts=True, show_valid_numbers=True, max_steps=max_steps)


def blanks(env):
    return [(int(r), int(c)) for r, c in zip(*np.nonzero(env.current_grid == 0))]


def record(seed, cfg, plan):
    env = SudokuEnv(cfg)
    text = env.reset(seed=seed)
    case = {"seed": seed, "difficulty": cfg.difficulty, "max_steps": cfg.max_steps,
            "puzzle": env.initial_grid.tolist(), "solution": env.solution_grid.tolist(),
            "text": text, "steps": []}
    for action in plan(env):
        if action is None:
            continue
        obs, reward, done, info = env.step(action)
        case["steps"].append({"action": action, "text": obs, "reward": float(reward),
                              "done": bool(done), "success": bool(info["success"]),
                              "action_is_valid": bool(info["action_is_valid"]),
                              "action_is_effective": bool(info["action_is_effective"])})
        if done:
            break
    return case


def mixed(env):
    """Every feedback kind and answer format on one level (actions chosen from its state)."""
    sol = env.solution_grid
    yield "hello"
    yield "Hello World, PLACE it somewhere"
    yield "place 5 at row 0 col 3"
    yield "2,10,5"
    yield "1,1,0"
    yield "place 12 at (1,1)"
    yield "place 007 at row 1 col 1"
    r, c = [(int(r), int(c)) for r, c in zip(*np.nonzero(env.initial_grid))][0]
    yield f"{r + 1},{c + 1},{sol[r, c]}"  # an initial cell
    # conflicts: a blank cell and a digit already in its row / column / box
    for (r, c) in blanks(env)[:4]:
        bad = [d for d in range(1, 10) if d not in get_valid_numbers(env.current_grid, r, c)]
        yield f"place {bad[0]} at row {r + 1} col {c + 1}"
        yield f"({r + 1},{c + 1},{bad[-1]})"
    formats = ["place {n} at row {r} col {c}", "place {n} at ({r},{c})", "place {n} at {r},{c}",
               "{n} at {r}, {c}", "({r}, {c}, {n})", "{r},{c},{n}", "I think: place {n} at row {r} col {c}!",
               "{r} , {c},{n}", "answer {r},{c},{n} that"]
    cells = blanks(env)
    for i, fmt in enumerate(formats):
        r, c = cells[i]
        valid = sorted(get_valid_numbers(env.current_grid, r, c))
        other = [d for d in valid if d != sol[r, c]]
        n = int(other[0]) if (i % 3 == 1 and other) else int(sol[r, c])
        yield fmt.format(n=n, r=r + 1, c=c + 1)
    # over an earlier placement: another digit if one fits, then its own digit again (conflict)
    for r, c in cells[:len(formats)]:
        if env.current_grid[r, c] != sol[r, c]:
            yield f"{r + 1},{c + 1},{sol[r, c]}"
            yield f"{r + 1},{c + 1},{sol[r, c]}"
            break
    r, c = cells[0]
    env_grid = env.current_grid.copy()
    env_grid[r, c] = 0
    fits = [d for d in get_valid_numbers(env_grid, r, c) if d != env.current_grid[r, c]]
    if fits:
        yield f"{r + 1},{c + 1},{fits[0]}"


def solve_all(env):
    """Every blank filled with the solution's digit, a few invalid answers on the way."""
    sol = env.solution_grid
    for i, (r, c) in enumerate(blanks(env)):
        if i in (5, 27):
            yield "nothing"
        yield f"place {sol[r, c]} at row {r + 1} col {c + 1}"


def short_budget(env):
    sol = env.solution_grid
    cells = blanks(env)
    yield "oops"
    yield "oops again"
    for r, c in cells:
        yield f"{r + 1},{c + 1},{sol[r, c]}"


def main():
    cases = [record(0, config(), mixed), record(1, config(), solve_all),
             record(2, config("medium", 4), short_budget), record(3, config("medium"), mixed),
             record(4, config(), solve_all)]
    print(json.dumps({"source": "mll-lab-nu/RAGEN@20daedc47558e000f7de912b060646bf2e8026bd "
                      "ragen/env/sudoku (render_format with_feedback)", "cases": cases},
                     indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
