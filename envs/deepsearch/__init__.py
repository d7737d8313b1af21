"""Deep Search: Search-R1-style search QA (``<search>``/``<answer>``) against a retriever server (BM25 by
default, dense optional) over a generated multi-hop world or FlashRAG data (``backend``, ``retriever``,
``world``, ``client``, ``expert``)."""
