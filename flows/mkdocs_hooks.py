"""MkDocs hooks (``mkdocs.yml``: ``hooks``): the reference pages are generated from the code at build time
(``flows.docs_reference``), never committed, so the site cannot show a setting or a command the code lacks."""

from __future__ import annotations

from typing import Any

from mkdocs.structure.files import File, Files

from flows.docs_reference import PAGES


def on_files(files: Files, config: Any) -> Files:
    for path, build in PAGES.items():
        files.append(File.generated(config, path, content=build()))
    return files
