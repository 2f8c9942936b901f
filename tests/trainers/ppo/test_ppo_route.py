"""The route of one PPO update, as `trl_ext/trainers/ppo/ppo_trainer.py`'s docstring writes it, is the code that runs.

One update (a rollout and all its optimizer steps) is traced with `sys.setprofile`: every trl_ext file whose code runs
is recorded, except inside the two boxes the route calls into — the rollout layer (`trl_ext/rollout`: sampling and
scoring) and the models (`trl_ext/models`, and `trl_ext/trainers/ppo/policy_value.py`'s forward they run) — and
their backward passes, which autograd runs for them. The import hook of the old module paths
(`trl_ext/trainers/_aliases.py`) is not route code either.
"""

from __future__ import annotations

import os
import re
import sys

from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

from trl_ext import PPOConfig, PPOTrainer
from trl_ext import testing as kit
from trl_ext.trainers.ppo import ppo_trainer

PACKAGE = os.path.dirname(os.path.abspath(kit.__file__)).rsplit(os.sep, 1)[0] + os.sep
BOXES = ("rollout" + os.sep, "models" + os.sep, os.path.join("trainers", "ppo", "policy_value.py"))
NOT_ROUTE = (os.path.join("trainers", "_aliases.py"),)
AUTOGRAD = os.path.join("torch", "autograd")


def _documented_route() -> set[str]:
    doc = ppo_trainer.__doc__
    route = doc[doc.index("The route of one PPO update") :]
    files = set(re.findall(r"`trl_ext/([\w/]+\.py)`", route))
    return files | {"trainers/ppo/ppo_trainer.py"}


def _relative(frame) -> str | None:
    name = frame.f_code.co_filename
    return os.path.relpath(name, PACKAGE).replace(os.sep, "/") if name.startswith(PACKAGE) else None


class _Tracer(TrainerCallback):
    """Records the route files of the first update (optimizer step 1 of a 1-step-per-rollout run)."""

    def __init__(self):
        self.files: set[str] = set()

    def _profile(self, frame, event, arg):
        if event != "call":
            return
        file = _relative(frame)
        if file is None or file.startswith(BOXES) or file in NOT_ROUTE:
            return
        caller = frame.f_back
        while caller is not None:  # called from inside a box, or by autograd: the box's own work
            inner = _relative(caller)
            if (inner is not None and inner.startswith(BOXES)) or AUTOGRAD in caller.f_code.co_filename:
                return
            caller = caller.f_back
        self.files.add(file)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            sys.setprofile(self._profile)

    def on_step_end(self, args, state, control, **kwargs):
        sys.setprofile(None)


def test_one_ppo_update_runs_the_documented_route_and_at_most_twelve_files(
    tmp_path, tiny_gpt_neox_dir, tiny_reward_dir
):
    args = PPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_ppo_epochs=1, num_mini_batches=1,
        total_episodes=4, response_length=5, stop_token="eos", learning_rate=1e-3, report_to="none",
        save_strategy="no", num_sample_generations=0, activation_checkpointing=False, step_unit="optimizer_step",
    )  # fmt: skip
    tracer = _Tracer()
    trainer = PPOTrainer(
        args=args, processing_class=AutoTokenizer.from_pretrained(tiny_gpt_neox_dir),
        model=AutoModelForCausalLM.from_pretrained(tiny_gpt_neox_dir),
        ref_model=AutoModelForCausalLM.from_pretrained(tiny_gpt_neox_dir),
        reward_model=AutoModelForSequenceClassification.from_pretrained(tiny_reward_dir, num_labels=1),
        value_model=AutoModelForSequenceClassification.from_pretrained(tiny_reward_dir, num_labels=1),
        train_dataset=kit.prompt_dataset(), callbacks=[tracer],
    )  # fmt: skip
    try:
        trainer.train()
    finally:
        sys.setprofile(None)
    assert trainer.state.global_step == 1
    documented = _documented_route()
    assert tracer.files == documented, (
        f"ran but not in the route: {sorted(tracer.files - documented)}; "
        f"in the route but did not run: {sorted(documented - tracer.files)}"
    )
    assert len(tracer.files) <= 12, sorted(tracer.files)
