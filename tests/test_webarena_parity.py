"""WebArena scoring parity: each rule where the reference harness (webarena/evaluation_harness/evaluators.py) is
particular, with the outcome the reference gives (worked out from its code), against ours."""

from __future__ import annotations

import pytest

from envs.webarena.evaluators import EvaluatorConfigError, program_html, string_match, url_match

# (reference_answers, answer, the reference harness's score)
STRING = [
    ({"exact_match": "Shipped"}, ' "shipped" ', 1.0),  # stripped, one pair of quotes dropped, lower-cased
    ({"exact_match": "Shipped"}, "'Shipped", 0.0),  # an unmatched quote stays
    ({"exact_match": "a b"}, "a  b", 0.0),  # inner whitespace is not collapsed
    ({"must_include": ["0"]}, "10 items", 0.0),  # one one-character phrase: matched against the tokens
    ({"must_include": ["0"]}, "0 items", 1.0),
    ({"must_include": ["5"]}, "It costs $5.", 1.0),  # "$", "5", "." are tokens
    ({"must_include": ["5"]}, "5.0", 0.0),  # "5.0" is one token
    ({"must_include": ["0", "items"]}, "10 items", 1.0),  # two phrases: plain substrings
    ({"must_include": ["25 |OR| twenty-five"]}, "twenty-five", 0.0),  # no alternatives in string_match
    ({"must_include": ["Borealis"]}, "the borealis 15", 1.0),
    ({"fuzzy_match": "N/A"}, "n/a", 1.0),  # exact N/A needs no judge
    ({"fuzzy_match": [""]}, "", 1.0),  # an empty answer: right only for an empty reference, no judge call
    ({"fuzzy_match": ["a cat"]}, "", 0.0),
]


@pytest.mark.parametrize(("reference", "answer", "expected"), STRING)
def test_string_match_scores_as_the_reference_harness(reference: dict, answer: str, expected: float) -> None:
    assert string_match(reference, answer, "intent") == expected


@pytest.mark.parametrize(("reference", "answer"), [({"fuzzy_match": "N/A"}, "it cannot be done"),
                                                    ({"fuzzy_match": ["a cat"]}, "a feline")])
def test_judged_answers_without_a_judge_are_refused_not_scored(reference: dict, answer: str) -> None:
    with pytest.raises(EvaluatorConfigError, match="judge"):
        string_match(reference, answer, "intent")


URLS = [
    ("http://h/shop/search?q=kettle", "http://h/shop/search/?q=kettle&page=1", 1.0),  # trailing /, extra keys
    ("http://h/shop", "http://h/shop/search", 1.0),  # GOLD in PRED: the reference's path inside the page's
    ("http://h/shop/search", "http://h/shop", 0.0),
    ("http://h/a?x=1 |OR| http://h/b?x=2", "http://h/b?x=1", 1.0),  # queries pooled over the alternatives
    ("http://h/a?x=1", "http://h/a?y=1", 0.0),
    ("http://h/a?x=1&x=2", "http://h/a?x=2", 1.0),
]


@pytest.mark.parametrize(("reference", "url", "expected"), URLS)
def test_url_match_scores_as_the_reference_harness(reference: str, url: str, expected: float) -> None:
    assert url_match(reference, url) == expected


def test_url_match_knows_only_gold_in_pred() -> None:
    with pytest.raises(EvaluatorConfigError, match="GOLD in PRED"):
        url_match("http://h/a", "http://h/a", "exact")


def test_program_html_reads_as_the_reference_harness() -> None:
    reads: list[tuple[str, str, list[str]]] = []
    pages = {("http://h/f/gardening/2/", ""): "<main><p>Tom &amp; Jerry</p><p>twenty-five votes</p></main>",
             ("last", "document.querySelector('main').innerText"): "8 votes"}

    def read(url: str, locator: str, prep: list[str]) -> str:
        reads.append((url, locator, prep))
        return pages.get((url, locator), "")

    targets = [
        # a helper in the URL, computed from the final page's URL; an empty locator: the page's HTML, unescaped
        {"url": "func:reddit_get_post_url('__last_url__')", "locator": "",
         "required_contents": {"must_include": ["Tom & Jerry", "25 |OR| twenty-five"]}},
        {"url": "last", "locator": "document.querySelector('main').innerText", "prep_actions": ["window.scroll(0,0)"],
         "required_contents": {"exact_match": "8 VOTES"}},
    ]
    assert program_html(targets, read, "http://h/f/gardening/2/comment/5") == 1.0
    assert reads[0] == ("http://h/f/gardening/2/", "", [])
    assert reads[1][2] == ["window.scroll(0,0)"]
    targets[1]["required_contents"] = {"must_include": ["9 votes"]}
    assert program_html(targets, read, "http://h/f/gardening/2/comment/5") == 0.0


@pytest.mark.parametrize(("target", "message"), [
    ({"url": "last", "locator": "func:shopping_get_latest_order_url()", "required_contents": {"exact_match": "x"}},
     "admin API"),
    ({"url": "last", "locator": "xpath=//main", "required_contents": {"exact_match": "x"}}, "unknown locator"),
    ({"url": "func:__import__('os').system('true')", "locator": "", "required_contents": {"exact_match": "x"}},
     "helper"),
])
def test_program_html_refuses_what_it_cannot_score_by_name(target: dict, message: str) -> None:
    with pytest.raises(EvaluatorConfigError, match=message):
        program_html([target], lambda url, locator, prep: "", "http://h/")
