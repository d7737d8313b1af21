"""Deep Search: Search-R1-style search QA (``<search>``/``<answer>``) against a retriever server (BM25 by
default, dense optional) over an offline multi-hop world or FlashRAG data. Arrives with the open-world
environments issue."""
