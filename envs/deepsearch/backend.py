"""Deep Search environment backend: Search-R1 search QA against a retriever server over HTTP.

Actions (already extracted from the model's reply by the client):

* ``<search>query</search>``: the backend asks the retriever for the top-k documents and answers
  ``<information>Doc 1(Title: t) text\\nDoc 2(...) ...</information>``;
* ``<answer>text</answer>``: exact match after normalisation (lower case, no punctuation, no articles)
  against any gold answer. Right: reward 1, success, done. Wrong: reward 0 and the episode goes on, so the
  agent may retry until the turn cap.

Options: ``retriever_url`` (default: start a retriever subprocess on a free port, stopped with the server
and killed with it), ``method`` (bm25 | dense) and ``corpus`` for that subprocess, ``topk`` (3), and
``qa`` (comma-separated FlashRAG parquet files, e.g. ``nq/test.parquet``; the file's parent folder names
the sub-task; default: the generated world's questions).
"""

from __future__ import annotations

import logging
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx

from envs.base import Backend as BaseBackend
from envs.base import EnvError, Environment, EpisodeFinishedError, StepResult
from envs.deepsearch.world import CATEGORIES, Question, default_world, exact_match


def first_tag(text: str, tag: str) -> tuple[int, str] | None:
    """(start, content) of the first complete ``<tag>...</tag>`` in ``text`` (what ``<tag>(.*?)</tag>`` finds), in
    linear time: the regex retries every opening tag when no closing one follows, which is quadratic."""
    start = text.find(f"<{tag}>")
    if start < 0:
        return None
    end = text.find(f"</{tag}>", start + len(tag) + 2)  # a later opening tag closes at the same place or not at all
    return None if end < 0 else (start, text[start + len(tag) + 2:end])

ACTIONS = ["<search> your query </search>", "<answer> your answer </answer>"]
FORMAT_HELP = ("Invalid action: write <search> query </search> to search, or <answer> answer </answer> to "
               "answer.")


MAX_QUERY_CHARS = 2000  # what the retriever takes (envs/deepsearch/retriever.py)
log = logging.getLogger(__name__)


class RetrieverError(EnvError):
    """The retriever server failed or is unreachable (a server-side problem, never a silent 0)."""

    status_code = 502


def load_flashrag(paths: list[str]) -> list[Question]:
    """FlashRAG QA parquet files (columns ``question`` and ``golden_answers``) as questions."""
    import pyarrow.parquet as pq

    out = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"QA file {path} not found")
        table = pq.read_table(path).to_pylist()
        category = path.parent.name or path.stem
        for row in table:
            answers = row.get("golden_answers") or row.get("answers") or []
            answers = [answers] if isinstance(answers, str) else list(answers)
            if not answers:
                raise ValueError(f"{path}: a row without golden_answers: {row.get('question')!r}")
            out.append(Question(str(row["question"]), tuple(str(a) for a in answers), category, 0))
    return out


def document(hit: dict[str, Any]) -> dict[str, str]:
    """One retrieved document as ``{title, text}``, from this project's retriever (``{id, title, text, score}``) or
    Search-R1's (``{document: {id, contents}, score}``, or ``{id, contents}`` without scores; ``contents`` is the
    quoted title on its first line, then the text)."""
    if "title" in hit and "text" in hit:
        return {"title": str(hit["title"]), "text": str(hit["text"])}
    contents = str(hit.get("document", hit)["contents"])
    title, _, text = contents.partition("\n")
    return {"title": title.strip().strip('"'), "text": text}


def start_retriever(method: str = "bm25", corpus: str = "world", timeout_s: float = 120.0
                    ) -> tuple[str, subprocess.Popen]:
    """Start ``python -m envs.deepsearch.retriever`` on a free port; it dies with this process."""
    from envs.launcher import start_helper

    return start_helper("envs.deepsearch.retriever", "--method", method, "--corpus", corpus, timeout_s=timeout_s)


class DeepSearchEnv(Environment):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.question: Question | None = None
        self.observation = ""
        self.done = False
        self.searches = 0

    def reset(self, data_idx: int) -> StepResult:
        self.question = self.backend.questions[data_idx]
        self.done, self.searches = False, 0
        self.observation = f"Question: {self.question.question}"
        return StepResult(self.observation, info={"category": self.question.category})

    def step(self, action: str) -> StepResult:
        if self.question is None or self.done:
            raise EpisodeFinishedError("the episode is finished (or was never reset): POST /reset first")
        answer, search = first_tag(action, "answer"), first_tag(action, "search")
        if search and (not answer or search[0] < answer[0]):
            query = " ".join(search[1].split())
            if not query:
                self.observation = "Empty search query: write <search> query </search> with some words."
            else:
                self.searches += 1
                self.observation = self.backend.information(query)
            return StepResult(self.observation)
        if answer:
            if exact_match(answer[1], self.question.answers):
                self.done = True
                self.observation = "Your answer is correct."
                return StepResult(self.observation, reward=1.0, score=1.0, done=True, success=True)
            self.observation = "Your answer is incorrect. You may search again or give another answer."
            return StepResult(self.observation)
        self.observation = FORMAT_HELP
        return StepResult(self.observation)

    def observe(self) -> str:
        return self.observation

    def available_actions(self) -> list[str]:
        return list(ACTIONS)


class Backend(BaseBackend):
    name = "deepsearch"
    id_field = "env_idx"

    def __init__(self, retriever_url: str | None = None, method: str = "bm25", corpus: str = "world",
                 topk: int | str = 3, qa: str | None = None) -> None:
        self.topk = int(topk)
        self.questions = load_flashrag([p for p in qa.split(",") if p]) if qa else default_world().questions
        self._proc: subprocess.Popen | None = None
        self.method, self.corpus, self.restarts = method, corpus, 0
        self._restart_lock = threading.Lock()
        if retriever_url is None:
            retriever_url, self._proc = start_retriever(method, corpus)
        self.retriever_url = retriever_url.rstrip("/")
        self.http = httpx.Client(base_url=self.retriever_url, timeout=60.0)

    @property
    def num_items(self) -> int:
        return len(self.questions)

    def sub_task(self, data_idx: int) -> str:
        self.check_index(data_idx)
        return self.questions[data_idx].category

    def new_instance(self) -> DeepSearchEnv:
        return DeepSearchEnv(self)

    def information(self, query: str) -> str:
        """The top-k documents for ``query`` in Search-R1's ``<information>`` format. A query longer than the
        retriever takes is cut (the agent's doing, not a server failure); a retriever this backend started that
        has died is restarted once."""
        query, proc = query[:MAX_QUERY_CHARS], self._proc
        try:
            hits = self._retrieve(query)
        except RetrieverError:
            if not self._restart_if_dead(proc):
                raise
            hits = self._retrieve(query)
        docs = "\n".join(f"Doc {i}(Title: {hit['title']}) {hit['text']}" for i, hit in enumerate(hits, 1))
        return f"<information>{docs}</information>"

    def _retrieve(self, query: str) -> list[dict[str, Any]]:
        try:
            response = self.http.post("/retrieve", json={"queries": [query], "topk": self.topk})
            response.raise_for_status()
            return [document(hit) for hit in response.json()["result"][0]]
        except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError, AttributeError) as err:
            raise RetrieverError(f"retriever at {self.retriever_url} failed: {err}") from err

    def _restart_if_dead(self, failed: subprocess.Popen | None) -> bool:
        """Restart the retriever this backend started if ``failed`` (its process when the request failed) has exited,
        reaping it; whether a retry may succeed."""
        with self._restart_lock:
            if failed is None:  # an outside retriever: not ours to restart
                return False
            if self._proc is not failed:  # another thread restarted it meanwhile
                return True
            if failed.poll() is None:  # alive: a real failure
                return False
            log.warning("the retriever (pid %d) exited with %s: restarting it", self._proc.pid, self._proc.returncode)
            url, self._proc = start_retriever(self.method, self.corpus)
            self.retriever_url = url.rstrip("/")
            self.http.close()
            self.http = httpx.Client(base_url=self.retriever_url, timeout=60.0)
            self.restarts += 1
            return True

    def problem(self) -> str | None:
        if self._proc is not None and self._proc.poll() is not None:
            return (f"the retriever (pid {self._proc.pid}) exited with {self._proc.returncode}; the next search "
                    "restarts it")
        return None

    def shutdown(self) -> None:
        self.http.close()
        if self._proc is not None:
            from envs.launcher import stop_server

            stop_server(self._proc)


__all__ = ["CATEGORIES", "Backend", "DeepSearchEnv", "load_flashrag", "start_retriever"]
