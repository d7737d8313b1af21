"""The import contracts of pyproject.toml ([tool.importlinter]): data walks one way, flows -> tasks ->
training -> envs; training and envs stay free of Prefect and DVC; no import circle inside a package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(root), "PATH": str(LINT.parent)})


def test_the_import_contracts_hold() -> None:
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "5 kept, 0 broken" in done.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("training/upward.py", "import tasks.stages\n", "no import upwards"),
    ("envs/orchestrated.py", "import prefect\n", "free of Prefect and DVC"),
    ("flows/circle.py", "import flows.cli\n", "no import circle"),
    ("training/engines/upward.py", "import training.evaluation.lineage\n", "engines know nothing of the trainer"),
    ("training/rl/upward.py", "import training.rollouts.rollout\n", "RL update knows nothing of sampling"),
])
def test_a_planted_violation_breaks_its_contract(tmp_path: Path, module: str, line: str, contract: str) -> None:
    for package in ("flows", "tasks", "training", "envs"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "data*"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / module).write_text(line)
    if module == "flows/circle.py":  # close the circle: cli imports the module that imports cli
        cli = tmp_path / "flows" / "cli.py"
        cli.write_text("import flows.circle\n" + cli.read_text())
    done = _lint(tmp_path)
    assert done.returncode != 0
    broken = [row for row in done.stdout.splitlines() if row.endswith("BROKEN")]
    # an engine or RL-update module importing a stage or the rollouts also closes a circle (they reach the engines and
    # the update): two contracts break
    assert len(broken) == (2 if module.startswith(("training/engines/", "training/rl/")) else 1), done.stdout[-2000:]
    assert contract in broken[0], done.stdout[-2000:]


def test_every_environment_variable_the_code_reads_is_on_the_settings_page() -> None:
    """docs/environment.md lists every SCALINGINTER_* variable the code and prefect.yaml read, and only those."""
    import re

    folders = ("envs", "training", "flows", "tasks", "benchmarks")
    sources = [p for folder in folders for p in (ROOT / folder).rglob("*.py")] + [ROOT / "prefect.yaml"]
    used = {m for p in sources for m in re.findall(r"SCALINGINTER_[A-Z0-9_]*[A-Z0-9]", p.read_text())}
    listed = set(re.findall(r"`(SCALINGINTER_[A-Z0-9_]+)`", (ROOT / "docs" / "environment.md").read_text()))
    assert used - listed == set(), f"read by the code, missing from docs/environment.md: {sorted(used - listed)}"
    assert listed - used == set(), f"on docs/environment.md, read nowhere: {sorted(listed - used)}"


def test_the_readme_and_the_guide_link_only_to_files_that_exist() -> None:
    """The README is short and points into docs/; every relative link of it and of the guide pages resolves."""
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150  # a newcomer's page; the detail is in docs/
