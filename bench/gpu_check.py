"""The GPU check of issue 35, ready to run: RePULSe and REINFORCE updates at the study's shape, and PPO on a
SmolLM2-135M-shaped model against TRL 1.12, in one command of at most ~8 minutes.

    python bench/gpu_check.py prepare                  # here, once: .gpu/ (wheels, SmolLM2's config and tokenizer,
                                                       # the study's training prompts), ~20 MiB, git-ignored
    python bench/gpu_check.py run --out "$OUT"         # on the GPU machine, with .gpu carried (device tool)
    python bench/gpu_check.py run --dry-run --out DIR  # on a CPU: the same steps on tiny models (tests/)

The GPU machine has no network and its own torch (2.11) and transformers (5.17, below our floor of 5.20), so
``prepare`` downloads the wheels trl_ext needs there (transformers 5.23, TRL 1.16, datasets and what they add to that
image) and TRL 1.12 for the peer, into ``.gpu/whl``; ``run`` installs them into ``/tmp/site`` (ours) and
``/tmp/site-trl112`` (TRL 1.12 alone, in front of ours for the peer). SmolLM2's weights (514 MB) cannot travel, so
``run`` builds a model of SmolLM2-135M-Instruct's exact architecture (its ``config.json``) with seeded random weights
and SmolLM2's tokenizer: the same compute per token. Responses then run to full length (random weights rarely sample
the stop token), which both benchmarks are told (``--full-length`` for PPO; the study shape has no stop token).

Steps of ``run`` (each writes its JSON under ``--out``; ``gpu_check.json`` sums them up with the card's name):

1. ``repulse_speed.py --shape study``: RePULSe vs REINFORCE, one round of each, with the bare floor;
2. ``repulse_speed.py --shape study --proposal-head``: the same with q a head on p's trunk;
3. ``ppo_vs_trl112.py --model smollm2 --full-length``: our PPO against TRL 1.12's, two A/B rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(REPO, ".gpu")
#: What the GPU image (py3.12, torch 2.11, transformers 5.17, no trl/datasets) lacks for ours, at the lock's versions;
#: the peer adds TRL 1.12 in front of them.
OURS_PACKAGES = ("transformers", "trl", "datasets", "dill", "multiprocess", "alt-profanity-check")
PEER_WHEELS = ("trl==1.12.0",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
SMOLLM2_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja")  # fmt: skip
MODEL_DIR_NAME = "smollm2-135m-instruct-fp32"  # what `trl_ext.models.smollm2.smollm2_path` looks for


# ------------------------------------------------------------------------------------------------------ prepare
def prepare(assets: str = ASSETS) -> None:
    """Fill ``assets`` (here, where pip and the converted SmolLM2 are): wheels, SmolLM2's config and tokenizer, and
    the study's training prompts."""
    from trl_ext.data import load_rtp_prompts
    from trl_ext.models.smollm2 import smollm2_path

    for name, wheels in (("whl", locked(OURS_PACKAGES)), ("whl-trl112", PEER_WHEELS)):
        target = os.path.join(assets, name)
        os.makedirs(target, exist_ok=True)
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", target, *wheels],
                       check=True)  # fmt: skip
    source, model_dir = smollm2_path(), os.path.join(assets, "smollm2")
    os.makedirs(model_dir, exist_ok=True)
    for name in SMOLLM2_FILES:
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), model_dir)
    with open(os.path.join(assets, "rtp_train_prompts.json"), "w") as f:
        json.dump([str(p) for p in load_rtp_prompts("train")["prompt"]], f)
    print(f"Wrote {assets} ({_size_mib(assets):.1f} MiB); carry it: run(..., carry=['.gpu']).")


def locked(names: tuple[str, ...], lock: str = os.path.join(REPO, "requirements", "lock.txt")) -> list[str]:
    """``name==version`` of each of ``names`` as the lock pins it."""
    with open(lock, encoding="utf-8") as f:
        pins = dict(line.strip().split("==", 1) for line in f if "==" in line and not line.startswith("#"))
    missing = [n for n in names if n not in pins]
    if missing:
        raise SystemExit(f"{lock} pins no {', '.join(missing)}.")
    return [f"{n}=={pins[n].split(';')[0].strip()}" for n in names]


def _size_mib(folder: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files) / 2**20


# ---------------------------------------------------------------------------------------------------------- run
def _install(assets: str) -> dict[str, str]:
    """Install the carried wheels; return the environment of each side's interpreter."""
    sites = {"ours": "/tmp/site", "peer": "/tmp/site-trl112"}
    for name, site in (("whl", sites["ours"]), ("whl-trl112", sites["peer"])):
        wheels = sorted(os.path.join(assets, name, w) for w in os.listdir(os.path.join(assets, name)))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", site, *wheels], check=True)  # fmt: skip
    # ours also imports trl_ext from this checkout (it is not installed there)
    return {"ours": f"{REPO}{os.pathsep}{sites['ours']}", "peer": f"{sites['peer']}{os.pathsep}{sites['ours']}"}


def _wrapper(path: str, pythonpath: str) -> str:
    """An interpreter that puts ``pythonpath`` in front (what ppo_vs_trl112.py launches for each side)."""
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nPYTHONPATH="{pythonpath}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    os.chmod(path, 0o755)
    return path


def _build_smollm2_shaped(python: str, assets: str, cache: str) -> None:
    """SmolLM2-135M-Instruct's architecture with seeded random weights and its tokenizer, where `smollm2_path`
    finds it (``cache/smollm2-135m-instruct-fp32``)."""
    target = os.path.join(cache, MODEL_DIR_NAME)
    code = (
        "import sys, shutil, torch\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "src, dst = sys.argv[1], sys.argv[2]\n"
        "torch.manual_seed(0)\n"
        "model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)\n"
        "model.save_pretrained(dst)\n"
        "import os\n"
        "[shutil.copy(os.path.join(src, f), dst) for f in os.listdir(src) if f != 'config.json']\n"
    )
    subprocess.run([python, "-c", code, os.path.join(assets, "smollm2"), target], check=True)


def _step(name: str, cmd: list[str], env: dict, out: str, summary: dict) -> None:
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, text=True, capture_output=True)
    with open(os.path.join(out, f"{name}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    print(proc.stdout[-6000:], proc.stderr[-3000:] if proc.returncode else "", flush=True)
    summary["steps"][name] = {"rc": proc.returncode, "seconds": time.perf_counter() - start, "command": cmd}


def run(out: str, dry_run: bool = False, assets: str = ASSETS) -> dict:
    """Run the check's steps (see the module docs) and write ``out/gpu_check.json``."""
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    summary: dict = {"dry_run": dry_run, "steps": {}}
    if dry_run:  # this interpreter's packages; the kit's tiny models; no peer
        ours = peer = sys.executable
    else:
        paths = _install(assets)
        ours = _wrapper("/tmp/python-ours", paths["ours"])
        peer = _wrapper("/tmp/python-trl112", paths["peer"])
        env["TRL_EXT_CACHE"] = "/tmp/trl_ext_cache"
        _build_smollm2_shaped(ours, assets, env["TRL_EXT_CACHE"])
    probe = "import json, torch; print(json.dumps({'cuda': torch.cuda.is_available(), 'torch': torch.__version__, " \
            "'device': torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}))"  # fmt: skip
    summary |= json.loads(subprocess.run([ours, "-c", probe], env=env, capture_output=True, text=True,
                                         check=True).stdout.strip().splitlines()[-1])  # fmt: skip
    speed = [ours, "bench/repulse_speed.py", "--shape", "study", "--rounds", "1", "--floor", "--floor-repeats", "2"]
    if dry_run:
        speed += ["--tiny", "--updates", "1", "--warmup", "0", "--prompts-per-step", "2", "--samples-per-prompt", "2",
                  "--response-length", "3", "--floor-repeats", "1"]  # fmt: skip
    else:
        speed += ["--updates", "3", "--prompts-file", os.path.join(assets, "rtp_train_prompts.json")]
    for name, extra in (("repulse_speed", []), ("repulse_speed_head", ["--proposal-head"])):
        _step(name, [*speed, *extra, "--output", os.path.join(out, f"{name}.json")], env, out, summary)
    ppo = [ours, "bench/ppo_vs_trl112.py", "--json", os.path.join(out, "ppo_vs_trl112.json"), "--ours-python", ours]
    if dry_run:  # ours only (the peer's venv is not here): the tiny GPT-NeoX job, one run
        ppo += ["--profile", "--batch", "8", "--micro-batch", "8", "--new-tokens", "4", "--updates", "2",
                "--peer-python", os.path.join(out, "no-peer")]  # fmt: skip
    else:
        ppo += ["--model", "smollm2", "--batch", "32", "--micro-batch", "16", "--new-tokens", "32", "--full-length",
                "--rounds", "2", "--updates", "4", "--peer-python", peer]  # fmt: skip
    _step("ppo_vs_trl112", ppo, env, out, summary)
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(summary, f, indent=1)
    failed = [name for name, step in summary["steps"].items() if step["rc"] != 0]
    print(f"gpu_check on {summary['device']}: " + ", ".join(
        f"{n} {s['seconds']:.0f} s (rc {s['rc']})" for n, s in summary["steps"].items()))  # fmt: skip
    if failed:
        raise SystemExit(f"gpu_check: {', '.join(failed)} failed; see {out}/<step>.log.")
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("prepare", "run"))
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="where results go ($OUT)")
    parser.add_argument("--dry-run", action="store_true", help="CPU: the same steps on tiny models, no installs")
    args = parser.parse_args(argv)
    if args.action == "prepare":
        prepare()
    else:
        run(args.out, dry_run=args.dry_run)


if __name__ == "__main__":
    main(sys.argv[1:])
