"""The documentation site (mkdocs.yml, docs/): it builds strict, its reference pages come from the code and name
every command and every setting, and the strict build does fail on a broken link."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import typer
from pydantic import BaseModel

from flows.cli import app
from flows.docs_reference import _sections, cli_markdown, settings_markdown

ROOT = Path(__file__).resolve().parent.parent
MKDOCS = Path(sys.executable).parent / "mkdocs"


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(config), "-d", str(site)], cwd=config.parent,
                          capture_output=True, text=True, timeout=300, env=env)


def test_the_site_builds_strict_with_the_reference_pages_generated(tmp_path: Path) -> None:
    done = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    settings = (tmp_path / "site" / "reference" / "settings" / "index.html").read_text()
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "kl_coef" in settings and "max_jvms" not in settings  # a field, not params.yaml's backend options
    assert "scalinginter train-phase" in cli and "--profile" in cli
    assert not (ROOT / "docs" / "reference").exists(), "the reference pages are generated, never committed"


def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    config = (ROOT / "mkdocs.yml").read_text().replace("flows/mkdocs_hooks.py", str(ROOT / "flows/mkdocs_hooks.py"))
    (tmp_path / "mkdocs.yml").write_text(config)
    page = tmp_path / "docs" / "guide" / "training.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


def _nested_models(model: type[BaseModel]) -> set[type[BaseModel]]:
    found: set[type[BaseModel]] = set()
    for info in model.model_fields.values():
        stack = [info.annotation]
        while stack:
            kind = stack.pop()
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found.add(kind)
            stack += list(getattr(kind, "__args__", ()) or ())
            stack += [m for m in getattr(kind, "__metadata__", ()) if isinstance(m, type)]
    return found


def test_every_setting_is_on_the_settings_page_with_what_it_does() -> None:
    page = settings_markdown()
    models = {model for _, _, model in _sections()}
    for _, _, model in _sections():
        missing = _nested_models(model) - models
        assert not missing, f"{model.__name__} nests {sorted(m.__name__ for m in missing)}: add them to _sections"
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__module__}.{model.__name__}.{name} has no description"
            assert f"| `{name}` |" in page


def test_every_command_is_on_the_cli_page() -> None:
    page = cli_markdown()
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    assert len(commands) > 15
    for name in commands:
        assert f"## `scalinginter {name}`" in page, name
