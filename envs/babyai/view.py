"""The agent's view of a minigrid env, computed in one pass: the same grid and visibility mask as minigrid's
``MiniGridEnv.gen_obs_grid``, which builds it by slicing the world and rotating the slice once per quarter turn
(new grids, an ``assert``-checked ``get``/``set`` per cell) and was about three quarters of a BabyAI server's step.
``install`` puts it on one env instance; ``tests/test_babyai.py`` checks it against minigrid's own on random walks.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
from minigrid.core.grid import Grid
from minigrid.core.world_object import Wall

# forward (dx, dy) per agent direction: right, down, left, up (minigrid's DIR_TO_VEC)
_FORWARD = ((1, 0), (0, 1), (-1, 0), (0, -1))


def gen_obs_grid(env: Any, agent_view_size: int | None = None) -> tuple[Grid, np.ndarray]:
    """The sub-grid the agent sees (it stands at the bottom middle, facing up) and which of its cells are
    visible: minigrid's ``gen_obs_grid``, cell for cell (the same objects; a fresh ``Wall`` outside the world)."""
    size = agent_view_size or env.agent_view_size
    world = env.grid
    width, height, cells = world.width, world.height, world.grid
    ax, ay = int(env.agent_pos[0]), int(env.agent_pos[1])
    dx, dy = _FORWARD[env.agent_dir]
    view = Grid(size, size)
    out = view.grid
    half = size // 2
    for j in range(size):
        ahead = size - 1 - j
        for i in range(size):
            right = i - half  # the right of a (dx, dy) heading is (-dy, dx)
            x, y = ax + dx * ahead - dy * right, ay + dy * ahead + dx * right
            out[j * size + i] = cells[y * width + x] if 0 <= x < width and 0 <= y < height else Wall()
    mask = np.ones(shape=(size, size), dtype=bool) if env.see_through_walls else _visible(out, size, (half, size - 1))
    out[(size - 1) * size + half] = env.carrying if env.carrying else None  # it sees what it carries
    return view, mask


def _visible(cells: list[Any], size: int, agent: tuple[int, int]) -> np.ndarray:
    """minigrid's ``Grid.process_vis`` on plain lists: which cells light spreads to from ``agent`` (row by row
    from the agent's, sideways then one row up, stopped by what cannot be seen behind); unseen cells are emptied."""
    seen = [[False] * size for _ in range(size)]  # seen[i][j]: column i, row j
    seen[agent[0]][agent[1]] = True
    for j in reversed(range(size)):
        for i in range(size - 1):
            if not seen[i][j]:
                continue
            cell = cells[j * size + i]
            if cell and not cell.see_behind():
                continue
            seen[i + 1][j] = True
            if j > 0:
                seen[i + 1][j - 1] = True
                seen[i][j - 1] = True
        for i in reversed(range(1, size)):
            if not seen[i][j]:
                continue
            cell = cells[j * size + i]
            if cell and not cell.see_behind():
                continue
            seen[i - 1][j] = True
            if j > 0:
                seen[i - 1][j - 1] = True
                seen[i][j - 1] = True
    for j in range(size):
        for i in range(size):
            if not seen[i][j]:
                cells[j * size + i] = None
    return np.array(seen, dtype=bool)


def install(env: Any) -> Any:
    """``env`` with this ``gen_obs_grid`` in place of minigrid's (every observation, and ``agent_sees``, use it)."""
    env.gen_obs_grid = types.MethodType(gen_obs_grid, env)
    return env
