"""The ``trl-ext`` command (installed with the package), as ``trl`` has one: ``trl-ext <command> [options]``.

    trl-ext ppo --config examples/ppo_tiny.yaml                 # in this process
    trl-ext repulse --help                                      # every option of a recipe
    trl-ext ppo --accelerate_config deepspeed_zero2 --num_processes 8 --config my.yaml
    accelerate launch -m trl_ext.recipes.ppo --config my.yaml   # the same recipe under your own launcher

Each command runs one recipe of :mod:`trl_ext.recipes` (the scripts in the repository's ``recipes/`` are thin entry
points to the same modules) with the options that follow it. ``--accelerate_config`` (a file, or the name of one of
the configurations that ship in ``trl_ext/accelerate_configs/``: ``single_gpu``, ``multi_gpu``, ``deepspeed_zero2``,
``deepspeed_zero3``, ``fsdp2``, ...) and the ``accelerate launch`` options ``--num_processes``, ``--num_machines``,
``--machine_rank``, ``--main_process_ip``, ``--main_process_port`` and ``--mixed_precision`` start the recipe through
``accelerate launch -m trl_ext.recipes.<recipe>``; without them it runs here, as ``python recipes/<recipe>.py`` does.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

__all__ = ["COMMANDS", "accelerate_config_path", "main"]

#: ``{command: (recipe module in trl_ext.recipes, what it does)}``.
COMMANDS = {
    "ppo": ("ppo", "PPO (TRL 1.12's PPOTrainer on current TRL)"),
    "repulse": ("harmlessness", "RePULSe: the harmlessness outer loop (a proposal q and the policy p)"),
    "harmlessness": ("harmlessness", "the same as `repulse`"),
    "grpo-repulse": ("grpo_repulse", "GRPO (TRL's GRPOTrainer) plus RePULSe's proposal and push-down term"),
    "proposal": ("proposal", "twist / proposal learning (CTL, SIXO, DPG, ...)"),
    "dpo": ("dpo", "DPO with trl_ext's extra losses"),
    "kto": ("kto", "KTO with trl_ext's extra losses"),
    "sft": ("sft", "supervised fine-tuning"),
    "reward": ("reward", "reward-model training on preference pairs"),
    "kd": ("kd", "knowledge distillation"),
    "prm": ("prm", "process reward model training"),
    "eval-heldout": ("eval_heldout", "held-out P(bad) / CVaR evaluation with intervals"),
    "eval-negdata": ("eval_negdata", "log-probabilities of saved negative samples"),
    "eval-gcg": ("eval_gcg", "GCG jailbreak attack (nanogcg)"),
    "eval-beast": ("eval_beast", "BEAST jailbreak attack"),
    "estimate-rare": ("estimate_rare_outputs", "rare-output probability estimation"),
    "plot-frontier": ("plot_frontier", "reward vs P(bad) / CVaR frontier plots"),
    "serve-rm": ("serve_rm", "serve a reward model over HTTP"),
    "batch-inference": ("batch_inference", "sample and score many prompts"),
    "chat": ("chat", "chat with a model in the terminal"),
    "merge-lora": ("merge_lora", "merge LoRA adapters into their base model"),
    "demo": ("demo_repulse", "the main demo: REINFORCE vs RePULSe on the paper's toy design"),
    "toy-study": ("toy_study", "the toy study over seeds (resumable)"),
    "study": ("study", "the RealToxicityPrompts study (resumable)"),
}

#: ``accelerate launch`` options the command passes on (each takes a value).
LAUNCH_OPTIONS = ("--num_processes", "--num_machines", "--machine_rank", "--main_process_ip", "--main_process_port",
                  "--mixed_precision")  # fmt: skip
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "accelerate_configs")


def accelerate_config_path(name: str) -> str:
    """The path of an accelerate configuration: an existing file as given, else one that ships with trl_ext
    (``"deepspeed_zero2"`` or ``"deepspeed_zero2.yaml"``)."""
    if os.path.isfile(name):
        return name
    shipped = os.path.join(CONFIG_DIR, name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if os.path.isfile(shipped):
        return shipped
    names = sorted(f[: -len(".yaml")] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))
    raise SystemExit(f"trl-ext: no accelerate config {name!r}: give a YAML file or one of {', '.join(names)}.")


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: trl-ext <command> [--accelerate_config NAME|FILE [launch options]] [recipe options]", "",
             "commands:"]  # fmt: skip
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`trl-ext <command> --help` lists a command's options. Shipped accelerate configs: "
              + ", ".join(sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".yaml"))) + "."]  # fmt: skip
    return "\n".join(lines)


def _split_launch(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(accelerate launch options, recipe options)`` from the arguments after the command."""
    launch, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ("--accelerate_config", "--accelerate-config", *LAUNCH_OPTIONS):
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"trl-ext: {name} needs a value.")
                value, i = argv[i + 1], i + 1
            if name.startswith("--accelerate"):
                launch += ["--config_file", accelerate_config_path(value)]
            else:
                launch += [name, value]
        else:
            rest.append(arg)
        i += 1
    return launch, rest


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(f"trl_ext {version('trl_ext')}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        raise SystemExit(f"trl-ext: unknown command {command!r}.\n\n{_usage()}")
    module = f"trl_ext.recipes.{COMMANDS[command][0]}"
    launch, rest = _split_launch(rest)
    if launch:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch, "-m", module, *rest]
        return subprocess.call(cmd)
    sys.argv = [f"trl-ext {command}", *rest]
    os.environ["TRL_EXT_COMMAND"] = command  # the recipe's usage line says `trl-ext <command>`
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
