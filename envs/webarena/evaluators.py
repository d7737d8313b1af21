"""WebArena's evaluators, on task configs in WebArena's JSON format, scoring as the reference harness does
(``webarena/evaluation_harness/evaluators.py``; each rule is a row of ``tests/test_webarena_parity.py``).

* answers are cleaned as the reference cleans them: stripped, one pair of surrounding quotes (single or double)
  removed, lower-cased (inner whitespace kept);
* ``string_match``: ``exact_match``; ``must_include`` (every phrase; a list of exactly one phrase of one
  character is matched against the answer's tokens, NLTK's word tokenizer, so ``0`` is not found in ``10``;
  no `` |OR| `` alternatives here); ``fuzzy_match`` through an LLM judge: a list of references, each judged (an
  empty answer is right only for an empty reference, without a judge call), or ``"N/A"``: an exact ``n/a``, else
  the judge decides whether the answer says the task cannot be done (against ``string_note``). The judge is an
  OpenAI-compatible ``/v1/chat/completions`` endpoint (``judge_url``, ``judge_model``, the API key from
  SCALINGINTER_JUDGE_API_KEY or OPENAI_API_KEY, never logged); without one such a task is refused, never 0;
* ``url_match`` (``url_note`` "GOLD in PRED", the only rule the reference has): some reference's host and path
  (trailing ``/`` dropped) is contained in the final page's, and for every query key of the references (their
  values pooled) the final page has one of the values;
* ``program_html``: for each target, ``url`` (``last``: the final page; ``func:reddit_get_post_url('__last_url__')``
  and the like: a helper of the reference, computed here) is opened, ``locator`` selects the text: empty means
  the page's whole HTML, ``document.…``/``[...document.…`` a JavaScript expression (after ``prep_actions``; an
  error selects ""), ``func:…`` a helper; HTML entities are unescaped; then ``exact_match`` or ``must_include``
  (here each phrase may list `` |OR| `` alternatives).

The score is the product of the evaluators' scores, as in WebArena. Helpers that need a site's admin API
(``shopping_get_latest_order_url``, ``shopping_get_sku_latest_review_*``) are refused with a clear error.
"""

from __future__ import annotations

import ast
import html
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx

OR = " |OR| "


class EvaluatorConfigError(ValueError):
    """The task's evaluation cannot run as configured (e.g. fuzzy_match without a judge)."""


@dataclass(frozen=True)
class Judge:
    """The LLM judge of fuzzy matches: an OpenAI-compatible endpoint, a model name and an API key (not in repr)."""

    url: str
    model: str = "judge"
    api_key: str | None = None

    def __repr__(self) -> str:
        return f"Judge(url={self.url!r}, model={self.model!r}, api_key={'set' if self.api_key else None})"

    @classmethod
    def from_options(cls, url: str | None, model: str | None = None) -> Judge | None:
        if not url:
            return None
        key = os.environ.get("SCALINGINTER_JUDGE_API_KEY") or os.environ.get("OPENAI_API_KEY")
        return cls(url, model or "judge", key)

    def ask(self, prompt: str) -> str:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        response = httpx.post(f"{self.url.rstrip('/')}/v1/chat/completions", timeout=60.0, headers=headers,
                              json={"model": self.model, "temperature": 0,
                                    "messages": [{"role": "user", "content": prompt}]})
        response.raise_for_status()
        return str(response.json()["choices"][0]["message"]["content"]).strip().lower()

    def same_meaning(self, intent: str, reference: str, answer: str) -> bool:
        verdict = self.ask(f"Task: {intent}\nReference answer: {reference}\nStudent answer: {answer}\n"
                           "Does the student answer convey the reference answer? Reply with exactly 'correct' or "
                           "'incorrect'.")
        return verdict.startswith("correct")

    def says_unachievable(self, intent: str, reason: str, answer: str) -> bool:
        verdict = self.ask(f"Task: {intent}\nThe task cannot be done because: {reason}\nStudent answer: {answer}\n"
                           "Does the student answer say that the task cannot be done, for this reason? Reply with "
                           "exactly 'same' or 'different'.")
        return verdict.startswith("same")


def clean_answer(text: str) -> str:
    """Strip, drop one pair of surrounding quotes, lower-case: the reference's ``clean_answer``."""
    text = str(text).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    return text.lower()


def word_tokens(text: str) -> list[str]:
    """NLTK's word tokenization (``word_tokenize``): sentences split first, then NLTK's Treebank-style tokenizer
    on each (sentence splitting by punctuation and space here: Punkt's model is a download this machine has not)."""
    from nltk.tokenize import NLTKWordTokenizer

    tokenizer = NLTKWordTokenizer()
    return [t for sentence in re.split(r"(?<=[.!?])\s+", text) if sentence for t in tokenizer.tokenize(sentence)]


def exact_match(reference: str, prediction: str) -> float:
    return float(clean_answer(prediction) == clean_answer(reference))


def must_include(reference: str, prediction: str, tokenize: bool = False) -> float:
    ref, pred = clean_answer(reference), clean_answer(prediction)
    if tokenize and len(ref) == 1 and len(word_tokens(ref)) == 1:
        return float(ref in word_tokens(pred))
    return float(ref in pred)


def string_match(reference: dict[str, Any], answer: str, intent: str, judge: Judge | None = None,
                 string_note: str = "") -> float:
    pred = clean_answer(answer)
    score = 1.0
    for approach, value in reference.items():
        if approach == "exact_match":
            score *= exact_match(value, pred)
        elif approach == "must_include":
            for phrase in value:
                score *= must_include(phrase, pred, tokenize=len(value) == 1)
        elif approach == "fuzzy_match":
            if value == "N/A":
                score *= exact_match("N/A", pred)
                if score != 1:
                    score = float(_judge(judge).says_unachievable(intent, string_note, pred))
            else:
                for target in value:
                    if not pred:
                        score *= float(not target)
                    else:
                        score *= float(_judge(judge).same_meaning(intent, target, pred))
        else:
            raise EvaluatorConfigError(f"unknown reference_answers approach {approach!r}")
    return score


def _judge(judge: Judge | None) -> Judge:
    if judge is None:
        raise EvaluatorConfigError("this task's string_match uses fuzzy_match, which needs an LLM judge: set the "
                                   "webarena backend options judge_url (an OpenAI-compatible endpoint) and "
                                   "judge_model, and SCALINGINTER_JUDGE_API_KEY if it needs a key")
    return judge


def _base_and_query(url: str) -> tuple[str, dict[str, list[str]]]:
    parsed = urlparse(url)
    return (parsed.netloc + parsed.path).rstrip("/"), parse_qs(parsed.query)


def url_match(reference: str, url: str, note: str = "GOLD in PRED") -> float:
    if note != "GOLD in PRED":
        raise EvaluatorConfigError(f"unknown url_note {note!r}: WebArena's only rule is 'GOLD in PRED'")
    pred_base, pred_query = _base_and_query(str(url).rstrip("/"))
    ref_bases, ref_query = [], {}
    for alternative in reference.split(OR):
        base, query = _base_and_query(alternative.strip().rstrip("/"))
        ref_bases.append(base)
        for key, values in query.items():
            ref_query.setdefault(key, set()).update(values)
    score = float(any(base in pred_base for base in ref_bases))
    for key, values in ref_query.items():
        score *= float(any(v in pred_query.get(key, []) for v in values))
    return score


def reddit_get_post_url(url: str) -> str:
    """A Postmill (reddit) comment URL cut to its post's: ``/f/<forum>/<post id>/``; any other URL unchanged."""
    parsed = urlparse(url)
    parts = parsed.path.split("/")
    if len(parts) < 4 or parts[1] != "f":
        return url
    return f"{parsed.scheme}://{parsed.netloc}/f/{parts[2]}/{parts[3]}/"


ADMIN_HELPERS = {"shopping_get_latest_order_url", "shopping_get_sku_latest_review_author",
                 "shopping_get_sku_latest_review_rating", "shopping_get_auth_token"}


def call_helper(expression: str, last_url: str, page_query: Callable[[str], str] | None = None) -> str:
    """A ``func:`` expression of a task config, parsed (never ``eval``-ed): the helpers that need only a URL or the
    page; ``__last_url__`` is the final page's URL, ``__page__`` the page."""
    text = expression.removeprefix("func:").replace("__last_url__", last_url)
    try:
        call = ast.parse(text, mode="eval").body
    except SyntaxError as err:
        raise EvaluatorConfigError(f"cannot parse the helper call {expression!r}: {err}") from None
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise EvaluatorConfigError(f"{expression!r} is not a helper call")
    name = call.func.id
    args = [a.id if isinstance(a, ast.Name) else ast.literal_eval(a) for a in call.args]
    if name == "reddit_get_post_url" and len(args) == 1:
        return reddit_get_post_url(str(args[0]))
    if name in ("get_query_text", "get_query_text_lowercase") and len(args) == 2 and page_query is not None:
        found = page_query(str(args[1]))
        return found.lower() if name.endswith("lowercase") else found
    if name in ADMIN_HELPERS:
        raise EvaluatorConfigError(f"helper {name} needs the shopping site's admin API, which this backend does not "
                                   "call: the task cannot be scored here")
    raise EvaluatorConfigError(f"unknown helper {name} in {expression!r}")


def program_html(targets: list[dict[str, Any]], read: Callable[[str, str, list[str]], str], last_url: str) -> float:
    """``read(url, locator, prep_actions)`` opens ``url`` (``last``: stay) and returns what ``locator`` selects:
    empty -> the page's HTML, a JavaScript expression -> its value as text ("" when it fails)."""
    score = 1.0
    for target in targets:
        url = target["url"]
        if url.startswith("func"):
            url = call_helper(url.split("func:", 1)[1], last_url)
        locator = target.get("locator", "") or ""
        if not locator.strip() or locator.startswith(("document.", "[...document.")):
            selected = read(url, locator.strip(), list(target.get("prep_actions", [])))
        elif locator.startswith("func:"):
            def query(selector: str, url: str = url) -> str:
                return read(url, f"document.querySelector({selector!r})?.textContent ?? ''", [])

            selected = call_helper(locator, last_url, query)
        else:
            raise EvaluatorConfigError(f"unknown locator {locator!r}")
        selected = html.unescape(selected)
        contents = target["required_contents"]
        if "exact_match" in contents:
            score *= exact_match(contents["exact_match"], selected)
        elif "must_include" in contents:
            for phrase in contents["must_include"]:
                score *= float(any(must_include(alt, selected) for alt in phrase.split(OR)))
        else:
            raise EvaluatorConfigError(f"unknown required_contents {sorted(contents)}")
    return score


def evaluate(task: dict[str, Any], answer: str, final_url: str, read: Callable[[str, str, list[str]], str],
             judge: Judge | None = None) -> float:
    """Score a finished episode of ``task`` (WebArena config, placeholders already replaced)."""
    spec = task["eval"]
    score = 1.0
    for kind in spec["eval_types"]:
        if kind == "string_match":
            score *= string_match(spec["reference_answers"], answer, task.get("intent", ""), judge,
                                  spec.get("string_note", ""))
        elif kind == "url_match":
            score *= url_match(spec["reference_url"], final_url, spec.get("url_note") or "GOLD in PRED")
        elif kind == "program_html":
            score *= program_html(spec["program_html"], read, final_url)
        else:
            raise EvaluatorConfigError(f"unknown eval type {kind!r} in task {task.get('task_id')}")
    return score
