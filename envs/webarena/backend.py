"""WebArena environment backend: a real headless Chromium (Playwright) on WebArena-format tasks.

Observation: the objective, the URL, the previous action, the open tabs and the page's accessibility
tree with element ids. Actions: WebArena's grammar (``envs.webarena.browser.parse_action``); ``stop
[answer]`` ends the episode and runs the task's evaluators (``envs.webarena.evaluators``).

Sites: task configs name them by WebArena's placeholders (``__SHOPPING__``, ``__REDDIT__``, ``__GITLAB__``,
``__SHOPPING_ADMIN__``, ``__MAP__``, ``__WIKIPEDIA__``), replaced by the backend options ``shopping``,
``reddit``, ... (the real sites' URLs). Without them, the shop and forum shipped in ``envs.webarena.site``
are started on a free port and serve ``__SHOPPING__`` and ``__REDDIT__``; each episode gets its own
sandbox of their state, reset at the start of the episode. Observations show them under
``http://webarena.local`` (``goto`` takes that name too) and number page elements 1, 2, ... in tree order,
so an episode reads the same in every run, whatever port the sites got.

Options: ``tasks`` (a WebArena JSON file or a folder of them; default ``data/webarena/tasks.json``),
``chromium`` (executable, default ``/usr/bin/chromium``), ``max_contexts`` (live episodes, each one
browser context; more is 503), ``memory_limit_mb`` (the browser's resident memory above which new episodes
are refused with 503), ``judge_url`` and ``judge_model`` (an OpenAI-compatible endpoint for ``fuzzy_match``; its
API key from SCALINGINTER_JUDGE_API_KEY or OPENAI_API_KEY, never logged), ``max_obs_chars``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import psutil

from envs.base import Backend as BaseBackend
from envs.base import CapacityError, EnvError, Environment, EpisodeFinishedError, StepResult
from envs.paths import project_root
from envs.webarena.browser import Action, ActionError, BrowserThread, ax_tree, element_center, parse_action
from envs.webarena.egress import EgressProxy
from envs.webarena.evaluators import EvaluatorConfigError, Judge, evaluate

# The shipped shop and forum run on a free port; observations name them by this host, so the same
# episode reads the same in every run (and the tokenizer corpus is reproducible).
LOCAL_ALIAS = "http://webarena.local"
PLACEHOLDERS = ("__SHOPPING_ADMIN__", "__SHOPPING__", "__REDDIT__", "__GITLAB__", "__MAP__", "__WIKIPEDIA__")
ACTIONS = ["click [id]", "type [id] [text] [press_enter_after=0|1]", "hover [id]", "press [key_comb]",
           "scroll [up|down]", "new_tab", "tab_focus [tab_index]", "close_tab", "goto [url]", "go_back",
           "go_forward", "stop [answer]"]


class EvaluationError(EnvError):
    """The task's evaluators cannot run (configuration); a server-side problem, never a silent 0."""

    status_code = 500


def load_tasks(source: str | Path) -> list[dict[str, Any]]:
    """WebArena task configs: one JSON file holding a list, or a folder of ``<task_id>.json`` files."""
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.json"), key=lambda p: (len(p.stem), p.stem))
        tasks = [json.loads(f.read_text()) for f in files]
    elif path.exists():
        data = json.loads(path.read_text())
        tasks = data if isinstance(data, list) else [data]
    else:
        raise FileNotFoundError(f"WebArena tasks {path} not found: pass a JSON file or a folder of them")
    for task in tasks:
        missing = {"intent", "start_url", "eval"} - set(task)
        if missing:
            raise ValueError(f"task {task.get('task_id')} in {path} lacks {sorted(missing)}")
    return tasks


def start_sites(timeout_s: float = 60.0) -> tuple[str, subprocess.Popen]:
    """Start the shipped shop and forum on a free port; they die with this process."""
    from envs.launcher import start_helper

    return start_helper("envs.webarena.site", timeout_s=timeout_s)


def _origin(url: str) -> str:
    """scheme://host:port of ``url`` (the port made explicit), lower case."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower(), 0)
    except ValueError:  # a port that is not a number
        return ""
    return f"{parts.scheme.lower()}://{(parts.hostname or '').lower()}:{port}"


def _rebase(url: str, prefixes: Iterable[tuple[str, str]]) -> str:
    """``url`` with the first matching ``old`` base URL replaced by ``new``, for (old, new) in ``prefixes``."""
    for old, new in prefixes:
        if url == old or url.startswith(old + "/"):
            return new + url[len(old):]
    return url


def _substitute(value: Any, sites: dict[str, str]) -> Any:
    if isinstance(value, str):
        for key in PLACEHOLDERS:
            if key in value and key in sites:
                value = value.replace(key, sites[key])
        return value
    if isinstance(value, list):
        return [_substitute(v, sites) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, sites) for k, v in value.items()}
    return value


class WebArenaEnv(Environment):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.context: Any = None
        self.pages: list[Any] = []
        self.active = 0
        self.cdp: Any = None
        self.task: dict[str, Any] | None = None
        self.sandbox = uuid.uuid4().hex
        self.previous = "None"
        self.done = False
        self.observation = ""
        self.page_observation = ""  # the page as last seen (observation = that, or an error message before it)
        self.ids: dict[int, int] = {}  # id shown in the observation -> DOM backend node id

    # -- everything below named _b_* runs on the browser thread --
    def _b_open(self) -> None:
        # the sandbox, twice: the egress proxy (loopback included) refuses every request to another origin, each
        # hop of a redirect too; the route filter refuses the other schemes (file:, chrome:) before any request
        self.context = self.backend.browser.browser.new_context(
            viewport={"width": 1280, "height": 720},
            proxy={"server": self.backend.egress.url, "bypass": "<-loopback>"})
        self.context.set_default_timeout(self.backend.step_timeout_ms)
        self.context.route("**/*", self._b_route)
        cookies = [{"name": "sandbox", "value": self.sandbox, "url": url} for url in self.backend.local_sites]
        if cookies:
            self.context.add_cookies(cookies)

    def _b_route(self, route: Any) -> None:
        if self.backend.allowed(route.request.url):
            route.continue_()
        else:
            route.abort("blockedbyclient")

    def _b_page(self) -> Any:
        return self.pages[self.active]

    def _b_focus(self, index: int) -> None:
        self.active = index
        page = self.pages[index]
        page.bring_to_front()
        self.cdp = self.context.new_cdp_session(page)

    def _b_observe(self) -> str:
        page = self._b_page()
        with contextlib.suppress(Exception):
            page.wait_for_load_state("load", timeout=self.backend.step_timeout_ms)
        tree, self.ids = ax_tree(self.cdp)
        limit = self.backend.max_obs_chars
        if len(tree) > limit:
            tree = tree[:limit] + "\n... (page truncated: scroll down or use other actions)"
        tabs = " | ".join(f"Tab {i}{' (current)' if i == self.active else ''}: {p.title()}"
                          for i, p in enumerate(self.pages))
        assert self.task is not None
        return (f"OBJECTIVE: {self.task['intent']}\nURL: {self.backend.shown_url(page.url)}\n"
                f"PREVIOUS ACTION: {self.previous}\nTABS: {tabs}\nOBSERVATION:\n{tree}")

    def _b_reset(self, task: dict[str, Any]) -> str:
        if self.context is not None:
            self.context.close()
        self._b_open()
        self.pages = [self.context.new_page()]
        self._b_focus(0)
        self.pages[0].goto(task["start_url"])
        return self._b_observe()

    def _b_act(self, action: Action) -> None:
        page = self._b_page()
        if action.kind in {"click", "hover", "type"}:
            if action.element not in self.ids:
                raise ActionError(f"there is no element [{action.element}] on this page")
            x, y = element_center(self.cdp, self.ids[action.element], action.element)
            if action.kind == "hover":
                page.mouse.move(x, y)
                return
            page.mouse.click(x, y)
            if action.kind == "type":
                page.keyboard.press("Control+A")
                page.keyboard.type(action.text)
                if action.flag:
                    page.keyboard.press("Enter")
        elif action.kind == "press":
            page.keyboard.press(action.text)
        elif action.kind == "scroll":
            page.mouse.wheel(0, 600 if action.text == "down" else -600)
        elif action.kind == "new_tab":
            self.pages.append(self.context.new_page())
            self._b_focus(len(self.pages) - 1)
        elif action.kind == "tab_focus":
            if not 0 <= (action.element or 0) < len(self.pages):
                raise ActionError(f"there is no tab {action.element}: tabs 0..{len(self.pages) - 1}")
            self._b_focus(action.element or 0)
        elif action.kind == "close_tab":
            if len(self.pages) == 1:
                raise ActionError("the last tab cannot be closed")
            self.pages.pop(self.active).close()
            self._b_focus(len(self.pages) - 1)
        elif action.kind == "goto":
            url = self.backend.real_url(action.text)
            if not self.backend.allowed(url):
                raise ActionError(f"goto is limited to this environment's sites ({', '.join(self.backend.sites_shown)})"
                                  f"; {action.text} is outside them")
            page.goto(url)
        elif action.kind == "go_back":
            page.go_back()
        elif action.kind == "go_forward":
            page.go_forward()

    def _b_read(self, url: str, locator: str, prep_actions: list[str]) -> str:
        """What a program_html target selects, as WebArena's harness reads it: the page's HTML for an empty
        locator, else the JavaScript expression's value after the prep actions ("" when it fails)."""
        if url == "last":
            page, temporary = self._b_page(), False
        else:
            if not self.backend.allowed(url):
                raise EvaluationError(f"program_html target {url} is not one of this environment's sites")
            page, temporary = self.context.new_page(), True
            page.goto(url)
        try:
            if not locator:
                return page.content()
            for action in prep_actions:
                with contextlib.suppress(Exception):
                    page.evaluate(f"() => {action}")
            try:
                value = page.evaluate(f"() => {locator}")
            except Exception:  # the page is not what the locator expects: nothing selected
                return ""
            return "" if value is None else str(value)
        finally:
            if temporary:
                page.close()

    def _b_close(self) -> None:
        if self.context is not None:
            self.context.close()
            self.context = None

    # -- the Environment interface (server threads) --
    def reset(self, data_idx: int) -> StepResult:
        self.backend.check_memory()
        self.backend.reset_sandbox(self.sandbox)
        self.task = self.backend.tasks[data_idx]
        self.previous, self.done = "None", False
        self.page_observation = self.observation = self.backend.browser.call(self._b_reset, self.task)
        return StepResult(self.observation, info={"sites": self.task.get("sites", []), "object": self.task["intent"]})

    def step(self, action_text: str) -> StepResult:
        if self.task is None or self.done:
            raise EpisodeFinishedError("the episode is finished (or was never reset): POST /reset first")
        try:
            action = parse_action(action_text)
        except ActionError as err:
            self.observation = f"{err}\n\n{self.page_observation}"
            return StepResult(self.observation, info={"terminated": False, "truncated": False})
        self.previous = action_text.strip().splitlines()[0]
        if action.kind == "stop":
            return self._finish(action.text)
        try:
            self.page_observation = self.observation = self.backend.browser.call(self._act_and_observe, action)
        except ActionError as err:
            self.observation = f"Action failed: {err}\n\n{self.page_observation}"
        return StepResult(self.observation, info={"terminated": False, "truncated": False})

    def _act_and_observe(self, action: Action) -> str:
        try:
            self._b_act(action)
            if action.kind in {"click", "type", "press"}:  # a navigation it starts begins a moment later
                self._b_page().wait_for_timeout(150)
        except ActionError:
            raise
        except Exception as err:  # a navigation timeout or a closed target: tell the agent, keep the episode
            raise ActionError(f"{action.kind} did not complete: {str(err).splitlines()[0]}") from err
        return self._b_observe()

    def _finish(self, answer: str) -> StepResult:
        assert self.task is not None
        final_url = self.backend.browser.call(lambda: self._b_page().url)
        try:
            score = evaluate(self.task, answer, final_url,
                             lambda url, locator, prep: self.backend.browser.call(self._b_read, url, locator, prep),
                             self.backend.judge)
        except EvaluatorConfigError as err:
            raise EvaluationError(str(err)) from err
        self.done = True
        self.observation = f"The task is finished. Answer: {answer}"
        return StepResult(self.observation, reward=score, score=score, done=True, success=score >= 1.0,
                          info={"terminated": True, "truncated": False, "url": final_url})

    def observe(self) -> str:
        return self.observation

    def available_actions(self) -> list[str]:
        return list(ACTIONS)

    def close(self) -> None:
        try:
            self.backend.browser.call(self._b_close)
        finally:
            self.backend.release(self.sandbox)


class Backend(BaseBackend):
    name = "webarena"
    id_field = "env_idx"

    def __init__(self, tasks: str | None = None, chromium: str = "/usr/bin/chromium", max_contexts: int | str = 8,
                 memory_limit_mb: float | str = 4096, judge_url: str | None = None, judge_model: str | None = None,
                 max_obs_chars: int | str = 12000, sandbox: bool | str = True,
                 step_timeout_s: float | str = 20, **sites: str) -> None:
        if not Path(chromium).exists():
            raise FileNotFoundError(f"chromium not found at {chromium}: install Debian's chromium "
                                    "(apt-get install chromium) or pass the option chromium=PATH")
        self.tasks_source = tasks or str(project_root() / "data" / "webarena" / "tasks.json")
        raw = load_tasks(self.tasks_source)
        self.max_contexts, self.memory_limit_mb = int(max_contexts), float(memory_limit_mb)
        self.judge, self.max_obs_chars = Judge.from_options(judge_url, judge_model), int(max_obs_chars)
        self.step_timeout_ms = float(step_timeout_s) * 1000
        known = {k.strip("_").lower(): k for k in PLACEHOLDERS}
        unknown = set(sites) - set(known)
        if unknown:
            raise ValueError(f"unknown webarena options {sorted(unknown)}: sites are {sorted(known)}")
        urls = {known[k]: v.rstrip("/") for k, v in sites.items()}
        self._sites_proc: subprocess.Popen | None = None
        self.local_sites: list[str] = []
        self.aliases: dict[str, str] = {}  # real base URL -> the stable name observations show
        needed = {p for p in PLACEHOLDERS if p in json.dumps(raw)}
        if needed & {"__SHOPPING__", "__REDDIT__"} - set(urls):
            base, self._sites_proc = start_sites()
            self.local_sites = [base]
            self.aliases[base] = LOCAL_ALIAS
            urls.setdefault("__SHOPPING__", f"{base}/shop")
            urls.setdefault("__REDDIT__", f"{base}/forum")
        missing = needed - set(urls)
        if missing:
            raise ValueError(f"tasks need the sites {sorted(missing)}: pass their URLs as options "
                             f"({', '.join(m.strip('_').lower() + '=URL' for m in sorted(missing))})")
        self.tasks = [_substitute(t, urls) for t in raw]
        self.origins = {_origin(u) for u in urls.values()}  # the only origins the browser may reach
        self.sites_shown = sorted({self.shown_url(u) for u in urls.values()})
        self.http = httpx.Client(timeout=30.0)
        self._lock = threading.Lock()
        self._live: set[str] = set()
        # every request of the browser, each hop of a redirect included, leaves through this filter
        self.egress = EgressProxy(self.allowed)
        self.egress.start()
        self.browser = BrowserThread(chromium, sandbox=str(sandbox).lower() not in ("false", "0", "no"))

    @property
    def capacity(self) -> int:
        return self.max_contexts

    def allowed(self, url: str) -> bool:
        """Whether the browser may load ``url``: http(s) on one of the environment's sites, or an inline page."""
        scheme = url.split(":", 1)[0].lower()
        return scheme in {"data", "about", "blob"} or (scheme in {"http", "https"} and _origin(url) in self.origins)

    def shown_url(self, url: str) -> str:
        """``url`` as observations show it: the shipped sites under LOCAL_ALIAS, whatever port they got."""
        return _rebase(url, self.aliases.items())

    def real_url(self, url: str) -> str:
        """The inverse of ``shown_url``, for the agent's ``goto`` actions."""
        return _rebase(url, ((alias, base) for base, alias in self.aliases.items()))

    @property
    def num_items(self) -> int:
        return len(self.tasks)

    def sub_task(self, data_idx: int) -> str:
        self.check_index(data_idx)
        task = self.tasks[data_idx]
        return task.get("category") or "+".join(task.get("sites", [])) or "web"

    def new_instance(self) -> WebArenaEnv:
        return WebArenaEnv(self)

    def check_memory(self) -> None:
        """Refuse new episodes (503) while the browser's processes hold more than ``memory_limit_mb``."""
        rss = 0.0
        for proc in psutil.Process(os.getpid()).children(recursive=True):  # Playwright's driver and chromium
            with contextlib.suppress(psutil.Error):  # renderer processes come and go
                if "chrom" in proc.name().lower():
                    rss += proc.memory_info().rss / 2**20
        if rss > self.memory_limit_mb:
            raise CapacityError(f"the browser uses {rss:.0f} MB, over memory_limit_mb={self.memory_limit_mb:.0f}:"
                                " close finished episodes or raise the limit")

    def reset_sandbox(self, sandbox: str) -> None:
        with self._lock:
            if sandbox not in self._live and len(self._live) >= self.max_contexts:
                raise CapacityError(f"all {self.max_contexts} browser contexts are in use: close finished instances "
                                    "or start the server with a larger max_contexts")
            self._live.add(sandbox)
        for base in self.local_sites:
            self.http.post(f"{base}/__sandbox/{sandbox}/reset").raise_for_status()

    def release(self, sandbox: str) -> None:
        with self._lock:
            self._live.discard(sandbox)
        for base in self.local_sites:
            with contextlib.suppress(httpx.HTTPError):
                self.http.delete(f"{base}/__sandbox/{sandbox}")

    def shutdown(self) -> None:
        try:
            self.browser.stop()
        finally:
            self.egress.stop()
            self.http.close()
            if self._sites_proc is not None:
                from envs.launcher import stop_server

                stop_server(self._sites_proc)
