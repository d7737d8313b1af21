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


#: each command the README shows, by its program and sub-command, and the test that runs it (through the same
#: program and sub-command, as a user types it)
README_COMMANDS = {
    "make run": "tests/test_flow.py::test_flow_runs_the_curriculum_and_a_killed_run_resumes",  # its scalinginter run
    "make test": ".ci/run",
    "scalinginter run": "tests/test_openworld_flow.py::test_main_job_runs_the_open_world_environments",
    "dvc repro": "tests/test_pipeline.py::test_dvc_repro_runs_the_curriculum_then_nothing_then_only_what_changed",
    "scalinginter pipeline": "tests/test_pipeline.py::test_changing_one_phase_changes_only_it_and_later_phases",
    "scalinginter check": "tests/test_preflight.py::test_scalinginter_check_exits_1_naming_the_fix_and_0_when_it_fits",
    "scalinginter lineage": "tests/test_flow.py::test_flow_runs_the_curriculum_and_a_killed_run_resumes",
    "scalinginter export": "tests/test_flow.py::test_flow_runs_the_curriculum_and_a_killed_run_resumes",
    "scalinginter eval": "tests/test_flow.py::test_flow_runs_the_curriculum_and_a_killed_run_resumes",
    "prefect deployment": "tests/test_deployment.py::test_prefect_deployment_run_babyai_end_to_end",
}


def _readme_commands() -> list[str]:
    """The program and sub-command of every line of the README's bash blocks."""
    text, found, inside = (ROOT / "README.md").read_text(), [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        words = line.split("#")[0].split()
        if inside and words:
            found.append(" ".join(words[:2]))
    return found


def _test_source(node: str) -> str:
    import ast

    path, _, name = node.partition("::")
    source = (ROOT / path).read_text()
    if not name:
        return source
    for item in ast.parse(source).body:
        if isinstance(item, ast.FunctionDef) and item.name == name:
            return ast.get_source_segment(source, item) or ""
    raise AssertionError(f"{node}: no such test")


def test_every_command_the_readme_shows_is_run_by_a_test() -> None:
    commands = _readme_commands()
    assert len(commands) >= 10 and "make run" in commands
    for command in commands:
        assert command in README_COMMANDS, f"the README shows `{command} ...`: name the test that runs it"
        program, sub = command.split()
        source = _test_source(README_COMMANDS[command])
        if command == "make test":  # CI runs it: .ci/run
            runs = "make test" in source
        elif command == "make run":  # the Makefile's run target is the main job, which the named test runs
            runs = ("scalinginter run --env babyai --profile smoke" in (ROOT / "Makefile").read_text()
                    and '"run", "--env", "babyai", "--profile", "smoke"' in (ROOT / "tests/test_flow.py").read_text())
        else:
            runs = f'"{sub}"' in source and (program == "scalinginter" or f'"{program}"' in source
                                             or f"{program}(" in source)
        assert runs, f"{README_COMMANDS[command]} does not run `{command}`"
