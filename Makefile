# Two commands do all the set-up on a fresh machine:
#   make run    the main job (see README)
#   make test   the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: run test install check-java lint bench

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: the CPU build lies on this machine's disk; any other request pulls a CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install --quiet $(TORCH)
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet -e '.[dev,deepspeed]' $(TORCH)
	touch $@

install: $(VENV)/.installed check-java

check-java:
	@java -version >/dev/null 2>&1 || { echo "Java (17+) is required for SciWorld: install openjdk-17-jre-headless"; exit 1; }

run: install
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/scalinginter run --env sciworld --profile smoke

test: install
	$(BIN)/python -m pytest -n 2 --durations=15

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python benchmarks/env_throughput.py
