"""A real headless Chromium driven by Playwright: accessibility-tree observations and WebArena's actions.

Playwright's sync API is bound to the thread that started it, while the environment server steps
instances from a thread pool; every browser call therefore runs on one dedicated thread
(:class:`BrowserThread`). Debian's chromium is used through ``executable_path``: no browser download.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from envs.paths import scratch_dir

FLAGS = ["--headless", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
UNPRIVILEGED = 65534  # nobody: the user Chromium runs as when this process is root (its sandbox refuses root)
_WRAPPER = """#!/bin/sh
# Chromium as an unprivileged user, so its own sandbox (namespaces, seccomp) is on: it refuses root
for a in "$@"; do case "$a" in --user-data-dir=*) chown -R {uid}:{uid} "${{a#--user-data-dir=}}";; esac; done
exec setpriv --reuid={uid} --regid={uid} --clear-groups env HOME={home} {chromium} "$@"
"""
SKIP_ROLES = {"generic", "none", "InlineTextBox", "LineBreak", "paragraph", "list", "group", "main",
              "navigation", "Section", "ListMarker"}
T = TypeVar("T")


class ActionError(ValueError):
    """An action the agent wrote is malformed or names no element; the message goes back to the agent."""


@dataclass(frozen=True)
class Action:
    kind: str
    element: int | None = None
    text: str = ""
    flag: bool = True


_ACTION = re.compile(r"^\s*(click|type|hover|press|scroll|new_tab|tab_focus|close_tab|goto|go_back|go_forward|stop)"
                     r"\s*(.*)$", re.DOTALL)


def bracketed(text: str) -> list[str]:
    r"""The contents of ``[...]`` in ``text``, left to right (what ``re.findall(r"\[(.*?)\]", text, re.DOTALL)``
    gives), in linear time: that regex retries every ``[`` when no ``]`` follows, which is quadratic."""
    out, pos = [], 0
    while (start := text.find("[", pos)) >= 0 and (end := text.find("]", start + 1)) >= 0:
        out.append(text[start + 1:end])
        pos = end + 1
    return out


def parse_action(text: str) -> Action:
    """WebArena's action grammar, e.g. ``click [12]``, ``type [7] [laptop] [1]``, ``stop [42]``."""
    match = _ACTION.match(text.strip().splitlines()[0] if text.strip() else "")
    if match is None:
        raise ActionError("Invalid action. Use one of: click [id], type [id] [text] [press_enter_after=0|1], "
                          "hover [id], press [key_comb], scroll [up|down], new_tab, tab_focus [tab_index], "
                          "close_tab, goto [url], go_back, go_forward, stop [answer].")
    kind, rest = match.group(1), match.group(2)
    args = bracketed(rest)
    if kind in {"click", "hover", "type"}:
        if not args or not args[0].strip().isdigit():
            raise ActionError(f"{kind} needs an element id in brackets, e.g. {kind} [12]")
        if kind == "type":
            if len(args) < 2:
                raise ActionError("type needs an element id and the text: type [id] [text] [press_enter_after=0|1]")
            flag = args[2].strip() != "0" if len(args) > 2 else True
            return Action(kind, int(args[0]), args[1], flag)
        return Action(kind, int(args[0]))
    if kind in {"press", "goto"}:
        if not args or not args[0].strip():
            raise ActionError(f"{kind} needs an argument in brackets, e.g. " +
                              ("press [Enter]" if kind == "press" else "goto [http://...]"))
        return Action(kind, text=args[0].strip())
    if kind == "scroll":
        direction = (args[0] if args else rest).strip().lower()
        if direction not in {"up", "down"}:
            raise ActionError("scroll needs a direction: scroll [up] or scroll [down]")
        return Action(kind, text=direction)
    if kind == "tab_focus":
        if not args or not args[0].strip().isdigit():
            raise ActionError("tab_focus needs a tab index, e.g. tab_focus [0]")
        return Action(kind, int(args[0]))
    if kind == "stop":
        return Action(kind, text=args[0].strip() if args else rest.strip())
    return Action(kind)


class BrowserThread:
    """One Chromium, one Playwright, one thread; ``call`` runs a function there and returns its result."""

    def __init__(self, executable_path: str, headless: bool = True, sandbox: bool = True) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="playwright")
        self.executable_path = executable_path
        self._home: str | None = None
        self.sandboxed = sandbox
        self.call(self._start, headless)

    def _executable(self) -> str:
        """Chromium itself, or (as root, where its sandbox will not start) a wrapper that runs it as nobody."""
        if not self.sandboxed or os.geteuid() != 0:
            return self.executable_path
        if shutil.which("setpriv") is None:
            raise RuntimeError("Chromium's sandbox refuses root and setpriv (util-linux) is missing to drop to an "
                               "unprivileged user: install util-linux, run as another user, or set the webarena "
                               "option sandbox=false (no OS sandbox for the browser)")
        self._home = str(scratch_dir("webarena-chromium-"))
        os.chown(self._home, UNPRIVILEGED, UNPRIVILEGED)
        wrapper = Path(self._home + "-launch.sh")
        wrapper.write_text(_WRAPPER.format(uid=UNPRIVILEGED, home=shlex.quote(self._home),
                                           chromium=shlex.quote(self.executable_path)))
        wrapper.chmod(0o700)
        return str(wrapper)

    def _start(self, headless: bool) -> None:
        from playwright.sync_api import sync_playwright

        self.playwright = sync_playwright().start()
        try:
            flags = FLAGS if self.sandboxed else [*FLAGS, "--no-sandbox"]
            self.browser = self.playwright.chromium.launch(executable_path=self._executable(), args=flags,
                                                           headless=headless, chromium_sandbox=self.sandboxed)
        except Exception:
            self.playwright.stop()
            self._cleanup()
            raise

    def _cleanup(self) -> None:
        if self._home is not None:
            shutil.rmtree(self._home, ignore_errors=True)
            Path(self._home + "-launch.sh").unlink(missing_ok=True)
            self._home = None

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        return self._pool.submit(fn, *args).result()

    def stop(self) -> None:
        def _stop() -> None:
            try:
                self.browser.close()
            finally:
                self.playwright.stop()

        try:
            self.call(_stop)
        finally:
            self._pool.shutdown(wait=True)
            self._cleanup()


def ax_tree(cdp: Any) -> tuple[str, dict[int, int]]:
    """The page's accessibility tree as WebArena-style text lines ``[id] role 'name'``, and {id: DOM node}.

    Ids number the shown nodes 1, 2, ... in tree order, so the same page reads the same in every run
    (DOM backend node ids depend on what the browser loaded before); the map gives each id's backend node
    id, stable while the page lives. Nodes without meaning of their own (generic containers, ignored nodes)
    are skipped but their children kept.
    """
    cdp.send("DOM.getDocument", {"depth": 0})
    nodes = cdp.send("Accessibility.getFullAXTree")["nodes"]
    by_id = {n["nodeId"]: n for n in nodes}
    lines: list[str] = []
    ids: dict[int, int] = {}

    def visit(node: dict[str, Any], depth: int) -> None:
        role = node.get("role", {}).get("value", "")
        name = str(node.get("name", {}).get("value", "") or "").strip()
        shown = not node.get("ignored") and role not in SKIP_ROLES and not (role == "StaticText" and not name)
        if role == "StaticText" and lines and lines[-1].strip().endswith(repr(name)):
            shown = False  # a link's or heading's own text, already in its name
        backend = node.get("backendDOMNodeId")
        if shown and backend is not None:
            props = []
            for prop in node.get("properties", []):
                if prop.get("name") in {"focused", "required", "checked", "selected", "expanded", "disabled"} and \
                        prop.get("value", {}).get("value"):
                    props.append(f"{prop['name']}: True")
            value = node.get("value", {}).get("value")
            if value not in (None, ""):
                props.append(f"value: {value!r}")
            shown_id = len(ids) + 1
            lines.append("\t" * depth + f"[{shown_id}] {role} {name!r}" + (" " + " ".join(props) if props else ""))
            ids[shown_id] = int(backend)
        for child in node.get("childIds", []):
            if child in by_id:
                visit(by_id[child], depth + (1 if shown else 0))

    roots = [n for n in nodes if "parentId" not in n]
    for root in roots:
        visit(root, 0)
    return "\n".join(lines), ids


CENTER = """function() {
  const el = this.nodeType === 3 ? this.parentElement : this;
  el.scrollIntoView({block: 'center', inline: 'center'});
  const r = el.getBoundingClientRect();
  return [r.left + r.width / 2, r.top + r.height / 2, r.width * r.height];
}"""


def element_center(cdp: Any, backend_id: int, shown_id: int | None = None) -> tuple[float, float]:
    """Viewport coordinates of the element's centre (scrolled into view); ActionError if it has none.

    ``shown_id`` is the element's id in the observation, which error messages name (default: ``backend_id``).
    """
    label = backend_id if shown_id is None else shown_id
    try:
        obj = cdp.send("DOM.resolveNode", {"backendNodeId": backend_id})["object"]
        box = cdp.send("Runtime.callFunctionOn", {"objectId": obj["objectId"], "functionDeclaration": CENTER,
                                                  "returnByValue": True})["result"]["value"]
    except Exception as err:  # the CDP error says the node is gone
        raise ActionError(f"element [{label}] is not on the page any more") from err
    if not box or box[2] <= 0:
        raise ActionError(f"element [{label}] is not visible")
    return float(box[0]), float(box[1])
