"""WebArena's evaluators, on task configs in WebArena's JSON format.

* ``string_match``: ``exact_match`` (after stripping and lower-casing), ``must_include`` (every phrase, each
  phrase may list alternatives joined by `` |OR| ``), ``fuzzy_match`` (an LLM judge: an OpenAI-compatible
  ``/v1/chat/completions`` endpoint given as ``judge_url``; without one such a task is refused, never scored 0).
* ``url_match``: the final page's URL against ``reference_url`` (alternatives joined by `` |OR| ``): same
  host and path, and the reference's query parameters present with the same values.
* ``program_html``: for each target, open ``url`` (``last`` is the final page) and evaluate ``locator``
  (a JavaScript expression; empty means the page's text) then check ``required_contents``.

The score is the product of the evaluators' scores, as in WebArena.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx


class EvaluatorConfigError(ValueError):
    """The task's evaluation cannot run as configured (e.g. fuzzy_match without a judge)."""


def _clean(text: str) -> str:
    return " ".join(str(text).strip().lower().split())


def _includes(phrase: str, text: str) -> bool:
    return any(_clean(alt) in _clean(text) for alt in phrase.split(" |OR| "))


def string_match(reference: dict[str, Any], answer: str, intent: str, judge_url: str | None = None) -> float:
    if "exact_match" in reference and _clean(answer) != _clean(reference["exact_match"]):
        return 0.0
    if "must_include" in reference and not all(_includes(p, answer) for p in reference["must_include"]):
        return 0.0
    if "fuzzy_match" in reference:
        targets = reference["fuzzy_match"]
        if targets == "N/A":
            return 1.0 if _clean(answer) in {"n/a", "na", "not applicable"} else 0.0
        if not judge_url:
            raise EvaluatorConfigError("this task's string_match uses fuzzy_match, which needs an LLM judge: set the "
                                       "webarena backend option judge_url (an OpenAI-compatible endpoint)")
        for target in targets:
            if not llm_judge(judge_url, intent, target, answer):
                return 0.0
    return 1.0


def llm_judge(url: str, intent: str, reference: str, answer: str, model: str = "judge") -> bool:
    """Ask an OpenAI-compatible chat endpoint whether ``answer`` means ``reference`` for ``intent``."""
    prompt = (f"Task: {intent}\nReference answer: {reference}\nStudent answer: {answer}\n"
              "Does the student answer convey the reference answer? Reply with exactly 'correct' or 'incorrect'.")
    response = httpx.post(f"{url.rstrip('/')}/v1/chat/completions", timeout=60.0,
                          json={"model": model, "temperature": 0, "messages": [{"role": "user", "content": prompt}]})
    response.raise_for_status()
    verdict = response.json()["choices"][0]["message"]["content"].strip().lower()
    return verdict.startswith("correct")


def url_match(reference: str, url: str) -> float:
    got = urlparse(url)
    got_query = parse_qs(got.query)
    for alternative in reference.split(" |OR| "):
        ref = urlparse(alternative.strip())
        same_page = (ref.netloc, ref.path.rstrip("/")) == (got.netloc, got.path.rstrip("/"))
        ref_query = parse_qs(ref.query)
        if same_page and all(got_query.get(k) == v for k, v in ref_query.items()):
            return 1.0
    return 0.0


def program_html(targets: list[dict[str, Any]], read: Callable[[str, str], str]) -> float:
    """``read(url, locator)`` returns the text the locator selects on that page (run in the browser)."""
    for target in targets:
        text = read(target["url"], target.get("locator", "") or "")
        contents = target["required_contents"]
        if "exact_match" in contents and _clean(text) != _clean(contents["exact_match"]):
            return 0.0
        if "must_include" in contents and not all(_includes(p, text) for p in contents["must_include"]):
            return 0.0
    return 1.0


def evaluate(task: dict[str, Any], answer: str, final_url: str, read: Callable[[str, str], str],
             judge_url: str | None = None) -> float:
    """Score a finished episode of ``task`` (WebArena config, placeholders already replaced)."""
    spec = task["eval"]
    score = 1.0
    for kind in spec["eval_types"]:
        if kind == "string_match":
            score *= string_match(spec["reference_answers"], answer, task.get("intent", ""), judge_url)
        elif kind == "url_match":
            score *= url_match(spec["reference_url"], final_url)
        elif kind == "program_html":
            score *= program_html(spec["program_html"], read)
        else:
            raise EvaluatorConfigError(f"unknown eval type {kind!r} in task {task.get('task_id')}")
    return score
