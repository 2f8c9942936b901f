"""Fingerprint RePULSe's training step: train `HarmlessnessTrainer` on the exact toy of
`tests/trainers/harmlessness/test_harmlessness_trainer.py` in twelve settings (both orders, extra proposal steps,
gradient accumulation 2 and 3, REINFORCE, tight clipping, a head proposal, reused proposal samples, a KL penalty,
SMC negatives, the unfused forward) and save, or compare against a saved run, the final weights of both models and
every logged value but timings. A change that must not change training (a refactor) is checked by saving on the
old commit and comparing on the new one: weights must be bit-identical.

    python bench/repulse_step_fingerprint.py save /tmp/fingerprint      # on the old commit
    python bench/repulse_step_fingerprint.py compare /tmp/fingerprint   # on the new one

One torch thread (thread counts change the rounding). About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "trainers" / "harmlessness")]

from test_harmlessness_trainer import snapshot, toy_args, toy_trainer  # noqa: E402

SETTINGS = {
    "default": {},
    "p_then_q": {"order": "p_then_q"},
    "q2": {"q_steps_per_p_step": 2},
    "ga2": {"gradient_accumulation_steps": 2, "max_steps": 3},
    "ga3": {"gradient_accumulation_steps": 3, "max_steps": 2},
    "smc": {"negative_sampler": "smc"},
    "reinforce": {"loss_type": "reinforce"},
    "clip": {"max_grad_norm": 0.01, "max_steps": 3},
    "head": {"parameterization": "modulation_linear_head", "max_steps": 3},
    "reuse": {"proposal_reuse_steps": 2, "max_steps": 4},
    "kl": {"kl_coef": 0.1, "max_steps": 3},
    "unfused": {},
}


def fingerprint(name: str, options: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    with tempfile.TemporaryDirectory() as folder:
        trainer = toy_trainer(toy_args(pathlib.Path(folder), **options))
        trainer.fuse_negative_forward = name != "unfused"
        trainer.train()
        weights = {f"policy.{k}": v for k, v in snapshot(trainer.policy).items()}
        if trainer.proposal is not None:
            weights.update({f"proposal.{k}": v for k, v in snapshot(trainer.proposal).items()})
        skip = ("timing", "runtime", "per_second")
        history = [{k: v for k, v in e.items() if not any(s in k for s in skip)} for e in trainer.state.log_history]
    return weights, json.loads(json.dumps(history))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["save", "compare"])
    parser.add_argument("folder", type=pathlib.Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.folder.mkdir(parents=True, exist_ok=True)
    differ = []
    for name, options in SETTINGS.items():
        weights, history = fingerprint(name, options)
        if args.mode == "save":
            torch.save(weights, args.folder / f"{name}.pt")
            (args.folder / f"{name}.json").write_text(json.dumps(history))
            continue
        saved = torch.load(args.folder / f"{name}.pt")
        same_weights = saved.keys() == weights.keys() and all(torch.equal(saved[k], weights[k]) for k in saved)
        same_history = json.loads((args.folder / f"{name}.json").read_text()) == history
        verdict = {True: "identical", False: "DIFFER"}
        print(f"{name:10s} weights {verdict[same_weights]}, logs {verdict[same_history]}")
        if not (same_weights and same_history):
            differ.append(name)
    if args.mode == "compare":
        print(
            f"{len(SETTINGS) - len(differ)} of {len(SETTINGS)} settings identical"
            + (f"; differ: {differ}" if differ else "")
        )
        if differ:
            sys.exit(1)


if __name__ == "__main__":
    main()
