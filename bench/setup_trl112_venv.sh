#!/usr/bin/env bash
# Create the peer virtualenv for bench/ppo_vs_trl112.py: TRL 1.12.0 (the last release that ships a PPO trainer, as
# trl.experimental.ppo) next to the same torch / transformers / accelerate / datasets versions as our .venv, so that
# the benchmark compares the two trainers and not two library stacks.
#
# Usage: bash bench/setup_trl112_venv.sh [VENV_DIR]        (default: bench/.venv-trl112, gitignored)
# Env:   PYTHON (interpreter to build the venv with, default python3), TORCH_SPEC (default torch==2.13.0; the CPU
#        wheel when pip's find-links points at it, otherwise pass the CUDA build you want).
#
# TRL 1.12 declares transformers>=4.56.2, accelerate>=1.4.0 and datasets>=4.7.0, so our pins satisfy it. Only the
# packages TRL 1.12's PPO imports are installed (no peft, no deepspeed): the benchmark runs full fine-tuning.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-bench/.venv-trl112}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
MAIN_PY="${MAIN_PY:-.venv/bin/python}"

# Same versions as the main venv when it exists, else the versions trl_ext is tested with.
pinned() {  # pinned <dist> <fallback>
    if [ -x "$MAIN_PY" ]; then
        "$MAIN_PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null && return
    fi
    echo "$2"
}
TRANSFORMERS="transformers==$(pinned transformers 5.23.0)"
ACCELERATE="accelerate==$(pinned accelerate 1.15.0)"
DATASETS="datasets==$(pinned datasets 4.8.5)"

"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q "trl==1.12.0" "$TRANSFORMERS" "$ACCELERATE" "$DATASETS" pandas psutil rich
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m

import trl.experimental.ppo  # noqa: F401  (fails here, not in the middle of a benchmark, if the stack is broken)

print("peer venv ready:", ", ".join(f"{d} {m.version(d)}" for d in ("torch", "trl", "transformers", "accelerate")))
PY
