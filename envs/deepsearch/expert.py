"""The Deep Search oracle: it knows each question's chain of relations (not the answers along the way),
issues one search per hop through the client, reads the next entity out of the returned documents, and
answers. Its success therefore measures the retriever and the environment, through HTTP."""

from __future__ import annotations

import re

from envs.client import BaseEnvClient, StepOutput
from envs.deepsearch.world import default_world

_KEYWORDS = {"birthplace": "born", "birth_year": "born", "occupation": "born", "alma_mater": "studied at",
             "country": "city in", "capital": "capital", "uni_city": "university located in", "founder": "founded by",
             "headquarters": "headquarters", "founded": "company founded", "director": "film directed by",
             "release": "film"}
_PATTERNS = {
    "birthplace": r"{s} \(born \d{{4}}\) is an? [a-z]+ born in ([^.]+)\.",
    "birth_year": r"{s} \(born (\d{{4}})\)",
    "occupation": r"{s} \(born \d{{4}}\) is an? ([a-z]+) born",
    "alma_mater": r"{s} studied at ([^.]+)\.",
    "country": r"{s} is a city in ([^.]+)\.",
    "capital": r"The capital of {s} is ([^.]+)\.",
    "uni_city": r"{s} is a university located in ([^.]+)\.",
    "founder": r"{s} is a company founded in \d{{4}} by ([^.]+)\.",
    "headquarters": r"{s} is a company founded in \d{{4}} by [^.]+\. Its headquarters are in ([^.]+)\.",
    "founded": r"{s} is a company founded in (\d{{4}})",
    "director": r"{s} is a \d{{4}} film directed by ([^.]+)\.",
    "release": r"{s} is a (\d{{4}}) film",
}


def _reply(thought: str, tag: str, text: str) -> str:
    return f"<think>{thought}</think>\n<{tag}> {text} </{tag}>"


def lookup(client: BaseEnvClient, relation: str, subject: str) -> tuple[str | None, StepOutput]:
    """Search for ``relation`` of ``subject``; the object read from the documents (None if not found)."""
    pattern = re.compile(_PATTERNS[relation].format(s=re.escape(subject)))
    out = client.step(_reply(f"I need the {relation} of {subject}.", "search", f"{subject} {_KEYWORDS[relation]}"))
    match = pattern.search(out.observation)
    if match is None:  # a broader query: the entity's own document
        out = client.step(_reply(f"Let me look up {subject} itself.", "search", subject))
        match = pattern.search(out.observation)
    return (match.group(1).strip() if match else None), out


def solve(client: BaseEnvClient, data_idx: int) -> StepOutput:
    """Reset ``data_idx`` and answer it by following its chain with searches; returns the last output."""
    client.reset(data_idx)
    question = default_world().questions[data_idx]
    if question.compare:
        relation = "birth_year" if question.question.startswith("who was born") else "release"
        years = {}
        for entity in question.compare:
            value, _ = lookup(client, relation, entity)
            years[entity] = int(value) if value else 10**9
        answer = min(question.compare, key=lambda e: years[e])
    else:
        subject: str | None = question.chain[0][1]
        for relation, _ in question.chain:
            if subject is None:
                break
            subject, _ = lookup(client, relation, subject)
        answer = subject or "unknown"
    return client.step(_reply("I have found the answer.", "answer", answer))
