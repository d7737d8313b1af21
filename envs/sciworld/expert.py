"""SciWorld expert: replay ScienceWorld's own gold action sequence through the HTTP client.

The gold sequence comes from a local simulator (one JVM per process, started on first use, reused,
stopped at exit): ``load(task, variation, generateGoldPath=True)`` then the gold action list, for the
task and variation the server names in its reset reply (``info["task_name"]``, ``info["var_num"]``).
Why not a frozen file: generating a gold path costs 0.1-3 s, the simulator is deterministic per
(task, variation), and a local simulator covers all 4639 items, where a file would cover a sample and
need regenerating whenever scienceworld changes. Results are cached per (task, variation).

Every gold action is sent as a full ReAct reply (``Thought: ...\\nAction: <action>``), so it goes
through the client's parser and the server exactly like a model's reply.
"""

from __future__ import annotations

import atexit
import threading

from envs.client import BaseEnvClient, StepOutput
from envs.sciworld.backend import load_items
from envs.sciworld.jvm_pool import SimulatorJVM, java_options

_lock = threading.Lock()
_jvm: SimulatorJVM | None = None
_cache: dict[tuple[str, int], tuple[str, ...]] = {}


def gold_actions(task_name: str, variation: int) -> list[str]:
    """ScienceWorld's gold action sequence for (task, variation), from the local simulator (cached)."""
    key = (task_name, int(variation))
    with _lock:  # one local JVM: gold paths are generated one at a time
        if key not in _cache:
            _cache[key] = tuple(_generate(*key))
        return list(_cache[key])


def _generate(task_name: str, variation: int) -> list[str]:
    global _jvm
    if _jvm is None or not _jvm.alive():
        _jvm = SimulatorJVM(java_options())
    _jvm.load(task_name, variation, "", True)
    actions = _jvm.gold_actions()
    if not actions or actions[0].startswith("ERROR"):
        raise RuntimeError(f"ScienceWorld produced no gold path for {task_name} variation {variation}: {actions[:1]}")
    return actions


def close_local_simulator() -> None:
    """Stop the expert's local JVM (also done at interpreter exit)."""
    global _jvm
    with _lock:
        if _jvm is not None:
            _jvm.close()
            _jvm = None


atexit.register(close_local_simulator)


def solve(client: BaseEnvClient, data_idx: int, max_turns: int = 200) -> StepOutput:
    """Reset ``data_idx`` through ``client`` and play its gold path; return the last StepOutput."""
    out = client.reset(data_idx)
    task_name, variation = out.info.get("task_name"), out.info.get("var_num")
    if task_name is None or variation is None:  # a server that omits AgentGym's fields: use the frozen list
        item = load_items()[data_idx]
        task_name, variation = item.task_name, item.variation
    actions = gold_actions(str(task_name), int(variation))
    for turn, action in enumerate(actions[:max_turns], start=1):
        if out.done:
            break
        reply = f"Thought: Step {turn} of {len(actions)} of the known solution is '{action}'.\nAction: {action}"
        out = client.step(reply)
    return out
