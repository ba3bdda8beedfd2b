"""ARC-AGI-2 tasks as text prompts, and a generator of synthetic tasks shaped like them.

Serialisation (the format of train_trace.jsonl): a grid is one line of digits per row, each
ending in a newline; a train pair is ``"Input:\\n" + grid + "Output:\\n" + grid``; pairs are
separated by a blank line; the prompt ends with the test input and ``"Output:\\n"``. The
expected output is the test output grid in the same form.
"""

from __future__ import annotations

import random
from bisect import bisect_right
from collections.abc import Sequence

Grid = list[list[int]]

# Empirical shape of the ARC-AGI-2 training set (1,000 tasks): how many train pairs and test
# inputs a task has, and quantiles of a grid's side length.
_TRAIN_PAIRS = ((2, 158), (3, 575), (4, 189), (5, 49), (6, 18), (7, 8), (8, 2), (10, 1))
_TEST_INPUTS = ((1, 931), (2, 63), (3, 5), (4, 1))
# NOTE: side quantiles are the data's, nudged so the serialised prompts match its figures
# (prompt chars median ~982, p99 ~6.2k; output median ~110) once pair counts are mixed in.
_SIDE_QUANTILES = (
    (0.0, 2.0),
    (0.10, 3.0),
    (0.25, 7.0),
    (0.50, 12.0),
    (0.75, 15.0),
    (0.90, 19.0),
    (0.97, 25.0),
    (0.99, 30.0),
    (1.0, 30.0),
)
_SAME_SHAPE = 0.66  # fraction of pairs whose output grid has the input's shape
_SMALLER = 0.22  # of the rest: most outputs are smaller crops, a few are enlargements


def grid_text(grid: Grid) -> str:
    """One line of digits per row, each ending in a newline."""
    return "".join("".join(str(cell) for cell in row) + "\n" for row in grid)


def parse_grid_text(text: str) -> Grid | None:
    """The grid a model wrote (rows of digits, each ending in a newline, all one width), else None."""
    if not text.endswith("\n"):
        return None
    rows = text[:-1].split("\n")
    if not rows[0] or any(
        len(row) != len(rows[0]) or not row.isdigit() or not row.isascii() for row in rows
    ):
        return None
    return [[int(c) for c in row] for row in rows]


def check_grid(grid: object, where: str) -> Grid:
    """Return grid if it is a non-empty rectangular list of digit rows, else raise ValueError."""
    ok = (
        isinstance(grid, list)
        and bool(grid)
        and all(
            isinstance(row, list) and row and all(isinstance(c, int) and 0 <= c <= 9 for c in row)
            for row in grid
        )
    )
    if not ok:
        raise ValueError(f"{where}: a grid must be a non-empty list of rows of digits 0-9")
    return grid  # type: ignore[return-value]


def task_prompts(task: object, where: str) -> list[tuple[str, str | None]]:
    """(prompt, expected output or None) for each test input of one ARC task dict."""
    if (
        not isinstance(task, dict)
        or not isinstance(task.get("train"), list)
        or not isinstance(task.get("test"), list)
        or not task["test"]
    ):
        raise ValueError(
            f"{where}: an ARC task is an object with 'train' and a non-empty 'test' list"
        )
    pairs = []
    for i, pair in enumerate(task["train"]):
        if not isinstance(pair, dict):
            raise ValueError(f"{where}: train[{i}] must be an object with 'input' and 'output'")
        inp = check_grid(pair.get("input"), f"{where}: train[{i}].input")
        out = check_grid(pair.get("output"), f"{where}: train[{i}].output")
        pairs.append("Input:\n" + grid_text(inp) + "Output:\n" + grid_text(out))
    shared = "".join(p + "\n" for p in pairs)
    result = []
    for i, test in enumerate(task["test"]):
        if not isinstance(test, dict):
            raise ValueError(f"{where}: test[{i}] must be an object with 'input'")
        inp = check_grid(test.get("input"), f"{where}: test[{i}].input")
        expected = None
        if test.get("output") is not None:
            expected = grid_text(check_grid(test["output"], f"{where}: test[{i}].output"))
        result.append((shared + "Input:\n" + grid_text(inp) + "Output:\n", expected))
    return result


def _weighted(rng: random.Random, table: Sequence[tuple[int, int]]) -> int:
    values, weights = zip(*table, strict=True)
    return rng.choices(values, weights=weights)[0]


def _side(rng: random.Random) -> int:
    """A grid side length drawn by inverse-CDF interpolation of the ARC quantiles."""
    u = rng.random()
    k = min(bisect_right([q for q, _ in _SIDE_QUANTILES], u), len(_SIDE_QUANTILES) - 1)
    (q0, v0), (q1, v1) = _SIDE_QUANTILES[k - 1], _SIDE_QUANTILES[k]
    return max(1, min(30, round(v0 + (v1 - v0) * (u - q0) / max(q1 - q0, 1e-9))))


def _random_grid(rng: random.Random, h: int, w: int, palette: list[int]) -> Grid:
    """Mostly background (0) with a few coloured cells, like ARC grids."""
    return [[rng.choice(palette) if rng.random() < 0.35 else 0 for _ in range(w)] for _ in range(h)]


def _output_for(
    rng: random.Random, grid: Grid, shape: str, scale: float, palette: list[int]
) -> Grid:
    h, w = len(grid), len(grid[0])
    if shape == "same":
        return [[rng.choice(palette) if rng.random() < 0.15 else c for c in row] for row in grid]
    oh = max(1, min(30, round(h * scale)))
    ow = max(1, min(30, round(w * scale)))
    return _random_grid(rng, oh, ow, palette)


def synthetic_task(rng: random.Random) -> dict:
    """One ARC-shaped task: grid sizes, pair counts and output shapes follow ARC-AGI-2."""
    n_train, n_test = _weighted(rng, _TRAIN_PAIRS), _weighted(rng, _TEST_INPUTS)
    base_h, base_w = _side(rng), _side(rng)
    if rng.random() < 0.5:  # many ARC grids are square
        base_w = base_h
    u = rng.random()
    if u < _SAME_SHAPE:
        shape, scale = "same", 1.0
    elif u < _SAME_SHAPE + _SMALLER:
        shape, scale = "smaller", rng.uniform(0.15, 0.6)
    else:
        shape, scale = "larger", rng.choice((2.0, 3.0))
    palette = rng.sample(range(1, 10), rng.randint(1, 4))

    def pair() -> dict:
        h = max(1, min(30, base_h + rng.randint(-2, 2)))
        w = max(1, min(30, base_w + rng.randint(-2, 2)))
        if shape == "larger":  # an enlargement starts from a small grid
            h, w = max(1, min(h, int(30 / scale))), max(1, min(w, int(30 / scale)))
        grid = _random_grid(rng, h, w, palette)
        return {"input": grid, "output": _output_for(rng, grid, shape, scale, palette)}

    return {"train": [pair() for _ in range(n_train)], "test": [pair() for _ in range(n_test)]}
