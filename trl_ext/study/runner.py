r"""Run a study: every training run once, each evaluation on the held-out prompts, cached and resumable.

For each :class:`~trl_ext.study.config.RunSpec` (a method's setting at one seed) :func:`run_study`:

1. skips it when ``<results_dir>/runs/<label>.json`` exists with the same key (:meth:`StudyConfig.run_key`, a hash of
   every setting that changes the result): a killed study resumes and loses at most the run in progress;
2. otherwise trains a fresh copy of the initial policy with the public trainers (`HarmlessnessTrainer` for
   REINFORCE / RePULSe / the p-as-proposal ablation, `PPOTrainer` with a separate critic for PPO), evaluating it with
   :func:`~trl_ext.eval.eval_heldout` after each of the run's ``eval_at`` updates (KL to the initial model);
3. writes the run's summary atomically (a temporary file, then ``os.replace``): its key, settings, per-evaluation
   metrics, the five worst held-out responses, and the time per update with the trainer's phase timings.

The untrained model is the study's ``initial`` method, evaluated once per seed (the sampling seed).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import subprocess
import tempfile
import time
from collections import defaultdict

import torch
from transformers import TrainerCallback

from ..eval.heldout import eval_heldout
from ..models.freeze import train_top_layers
from .config import RunSpec, StudyConfig

__all__ = ["StudyContext", "evaluate_policy", "run_study", "summary_path"]

logger = logging.getLogger(__name__)

_COMMON_OPTIONS = {
    "lr_scheduler_type": "constant",
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "bf16": False,
    "use_cpu": True,
    "stop_token": "eos",
    "disable_tqdm": True,
    # TRL-style configs checkpoint activations by default; with frozen lower blocks that makes every backward run
    # through the whole model. Off for every method (the same gradients, less time).
    "activation_checkpointing": False,
}


# ------------------------------------------------------------------------------------------------ context
class StudyContext:
    """What every run shares: the initial policy and tokenizer, the reward, and the two prompt sets."""

    def __init__(self, config: StudyConfig):
        from ..data import load_rtp_prompts

        self.config = config
        self.model, self.tokenizer = load_policy(config.model)
        self.model.eval().requires_grad_(False)
        self.reward = make_reward(config)
        split = {"heldout_fraction": config.heldout_fraction, "seed": config.split_seed}
        train = load_rtp_prompts("train", max_per_category=config.train_per_category, **split)
        self.train_dataset = train.select_columns(["prompt"])
        # The evaluation prompts: the held-out side, or (for tuning the budget) training prompts.
        self.heldout = load_rtp_prompts(config.eval_prompts, max_per_category=config.eval_per_category, **split)
        self.offensiveness = config.reward == "offensiveness"
        if self.offensiveness:  # r = log(max(1 - p, floor)): p > t  <=>  r < log(1 - t)
            self.threshold_names = [str(t) for t in config.p_offensive_thresholds]
            self.thresholds = [math.log(1.0 - t) for t in config.p_offensive_thresholds]
        else:
            self.threshold_names = [f"r<{t:g}" for t in config.reward_thresholds]
            self.thresholds = [float(t) for t in config.reward_thresholds]


def load_policy(name: str):
    """``(model, tokenizer)`` in fp32: SmolLM2-135M-Instruct, the kit's tiny Llama, or a local folder."""
    if name == "smollm2":
        from ..models.smollm2 import load_smollm2

        return load_smollm2()
    if name == "tiny":
        from ..testing import build_causal_lm, build_tokenizer

        tokenizer = build_tokenizer(pad_equals_eos=True, padding_side="left")
        return build_causal_lm("llama", tokenizer=tokenizer, seed=0), tokenizer
    if not os.path.isdir(name):
        raise ValueError(f"model must be 'smollm2', 'tiny' or a local model folder; {name!r} is none of them.")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32), tokenizer


def make_reward(config: StudyConfig):
    """The offensiveness classifier, or ``(sequence classifier, its tokenizer)`` read from a local folder."""
    if config.reward == "offensiveness":
        from ..rewards.toxicity import OffensivenessReward

        return OffensivenessReward(floor=config.reward_floor)
    if not os.path.isdir(config.reward):
        raise ValueError(
            f"reward must be 'offensiveness' or the folder of a sequence-classification reward model; "
            f"{config.reward!r} is neither."
        )
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(config.reward, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(config.reward)


# ------------------------------------------------------------------------------------------------ evaluation
def evaluate_policy(context: StudyContext, model, seed: int) -> dict:
    """Held-out metrics of ``model`` (KL to the initial model), with ``P(p_offensive > t)`` read off the rewards.

    The sampling seed is ``config.eval_seed`` when set (the same random streams for every run: common random
    numbers), else ``seed``. With ``save_eval_samples`` the report keeps, per response (prompt-major, ``N`` per
    prompt), its reward, KL and whether it holds a word of the lexicon (:data:`~trl_ext.rewards.OFFENSIVE_WORDS` and
    :data:`~trl_ext.rewards.HELDOUT_OFFENSIVE_WORDS`: a held-out check that no training reward reads)."""
    config = context.config
    seed = config.eval_seed if config.eval_seed is not None else seed
    start = time.perf_counter()
    report = eval_heldout(
        model, context.tokenizer, context.heldout, context.reward, ref_model=context.model,
        num_samples_per_prompt=config.eval_samples_per_prompt, max_new_tokens=config.response_length,
        temperature=config.temperature, kl_coef=config.kl_coef, batch_size=config.eval_batch_size,
        thresholds=context.thresholds, cvar_alphas=[config.cvar_alpha], seed=seed, show_progress=False,
        save_samples=True,
    )  # fmt: skip
    samples = report.pop("samples")
    rewards = torch.tensor(samples["reward"], dtype=torch.float64)
    worst = torch.argsort(rewards)[:5].tolist()
    if context.offensiveness:  # r = log(max(1 - p, floor)): p = 1 - exp(r), exact above the floor
        report["p_offensive_mean"] = float((1.0 - rewards.exp()).mean())
    report["p_offensive_threshold_map"] = dict(zip(context.threshold_names, context.thresholds))
    report["worst_samples"] = [
        {"prompt": samples["prompts"][samples["prompt_index"][i]], "response": samples["response"][i],
         "reward": float(rewards[i])}
        for i in worst
    ]  # fmt: skip
    if config.save_eval_samples:
        lexicon = _lexicon()
        report["per_sample"] = {
            "samples_per_prompt": config.eval_samples_per_prompt,
            "prompt_index": samples["prompt_index"],
            "reward": [round(float(r), 5) for r in samples["reward"]],
            "kl": [round(float(k), 5) for k in samples["kl"]],
            "lexicon": [int(lexicon.contains(_plain(text, context.tokenizer))) for text in samples["response"]],
        }
        report["lexicon_rate"] = sum(report["per_sample"]["lexicon"]) / len(samples["response"])
    report["eval_seed"] = seed
    report["eval_seconds"] = time.perf_counter() - start
    return report


def _lexicon():
    from ..rewards import HELDOUT_OFFENSIVE_WORDS, OFFENSIVE_WORDS, LexicalReward

    return LexicalReward(words=tuple(OFFENSIVE_WORDS) + tuple(HELDOUT_OFFENSIVE_WORDS))


def _plain(text: str, tokenizer) -> str:
    """A decoded response without the special tokens that ``save_samples`` keeps (EOS, padding)."""
    for token in tokenizer.all_special_tokens:
        text = text.replace(token, " ")
    return text


class _EvalAt(TrainerCallback):
    """Evaluates the policy after given numbers of *updates* (optimizer steps ÷ steps per update) and keeps the
    trainer's per-step ``timing/*`` logs."""

    def __init__(self, context, run: RunSpec, steps_per_update: int):
        self.context, self.run, self.steps_per_update = context, run, steps_per_update
        self.policy = None
        self.evals: list[dict] = []
        self.timings: dict[str, list[float]] = defaultdict(list)
        self.eval_seconds = 0.0

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key, value in (logs or {}).items():
            if key.startswith("timing/"):
                self.timings[key].append(float(value))

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.steps_per_update:
            return
        updates = state.global_step // self.steps_per_update
        if updates in self.run.eval_at:
            report = evaluate_policy(self.context, self.policy, self.run.seed)
            self.eval_seconds += report["eval_seconds"]
            self.evals.append({"updates": updates, **report})


def _train(context: StudyContext, run: RunSpec, results_dir: str | None = None) -> dict:
    config = context.config
    model = copy.deepcopy(context.model).train().requires_grad_(True)
    trainable = train_top_layers(model, config.trainable_layers)
    updates = max(run.eval_at)
    work = tempfile.mkdtemp(prefix=f"study-{run.label}-")
    common = {
        **_COMMON_OPTIONS,
        "output_dir": work,
        "per_device_train_batch_size": config.prompts_per_update,
        "num_samples_per_prompt": config.samples_per_prompt,
        "response_length": config.response_length,
        "temperature": config.temperature,
        "learning_rate": config.learning_rate,
        "kl_coef": config.kl_coef,
        "seed": run.seed,
        "local_rollout_forward_batch_size": config.prompts_per_update * config.samples_per_prompt,
    }
    if run.trainer == "ppo":
        from ..trainers import PPOConfig, PPOTrainer

        # PPOConfig's batch counts responses (prompts per rollout = batch / num_samples_per_prompt): the same
        # responses per update as the other methods.
        responses = config.prompts_per_update * config.samples_per_prompt
        options = {**common, "per_device_train_batch_size": responses, "num_ppo_epochs": 2, "num_mini_batches": 1}
        options.update(run.options)
        steps_per_update = options["num_ppo_epochs"] * options["num_mini_batches"]
        args = PPOConfig(**options, max_steps=updates, step_unit="update")  # max_steps counts PPO updates
        value_model = _value_model(context.model, config.trainable_layers)
        callback = _EvalAt(context, run, steps_per_update)
        trainer = PPOTrainer(
            args=args, processing_class=context.tokenizer, model=model, ref_model=context.model,
            reward_model=context.reward, train_dataset=context.train_dataset, value_model=value_model,
            callbacks=[callback],
        )  # fmt: skip
    else:
        from ..trainers import HarmlessnessConfig, HarmlessnessTrainer

        options = {**common, **run.options}
        args = HarmlessnessConfig(**options, max_steps=updates)
        callback = _EvalAt(context, run, 1)
        trainer = HarmlessnessTrainer(
            args=args, processing_class=context.tokenizer, model=model, reward_model=context.reward,
            train_dataset=context.train_dataset, callbacks=[callback], ref_model=context.model,
        )  # fmt: skip
    callback.policy = getattr(trainer, "policy", None) or trainer.policy_model
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start - callback.eval_seconds
    if results_dir is not None and run.seed == config.rare_seed:  # the rare stage reads the trained policy back
        from .rare import policy_path, save_policy_weights

        save_policy_weights(callback.policy, policy_path(results_dir, run))
    done = [e["updates"] for e in callback.evals]
    if done != run.eval_at:
        raise RuntimeError(f"{run.label}: evaluated after updates {done}, expected {run.eval_at}; check eval_at.")
    return {
        "evals": callback.evals,
        "train_seconds": train_seconds,
        "seconds_per_update": train_seconds / updates,
        "timings_mean": {k: sum(v) / len(v) for k, v in callback.timings.items()},
        "trainable_parameters": trainable,
        "trainer_options": {k: v for k, v in options.items() if k != "output_dir"},
    }


def _value_model(policy, trainable_layers: int):
    """A critic with the initial policy's trunk and a fresh one-output head (trained: top blocks + head)."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    critic = AutoModelForSequenceClassification.from_config(config).to(torch.float32)
    missing, unexpected = critic.load_state_dict(policy.state_dict(), strict=False)
    if any(not name.startswith("score") for name in missing):
        raise RuntimeError(f"The critic could not take the policy's trunk; missing {missing[:5]}.")
    train_top_layers(critic, trainable_layers, extra_modules=("score",))
    return critic.train()


# ------------------------------------------------------------------------------------------------ files
def summary_path(results_dir: str, run: RunSpec) -> str:
    return os.path.join(results_dir, "runs", f"{run.label}.json")


def _read_summary(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _write_atomic(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".run-", suffix=".json.tmp", dir=os.path.dirname(path))
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=float)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _commit_file(path: str, message: str) -> None:
    """``git commit`` only ``path`` (other staged work is left alone), in the repository that holds it; a busy index
    is retried, then skipped with a warning. Outside a git work tree nothing is committed (a warning says so)."""
    folder = os.path.dirname(os.path.abspath(path))
    check = ["git", "-C", folder, "rev-parse", "--is-inside-work-tree"]
    inside = subprocess.run(check, capture_output=True, text=True)
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        logger.warning("Not committing %s: it is not inside a git work tree.", path)
        return
    name = os.path.basename(path)
    ignored = subprocess.run(["git", "-C", folder, "check-ignore", "-q", "--", name], capture_output=True)
    if ignored.returncode == 0:
        logger.warning("Not committing %s: a .gitignore rule ignores it (git check-ignore -v shows which).", path)
        return
    error = ""
    for attempt in range(5):
        add = subprocess.run(["git", "-C", folder, "add", "--", name], capture_output=True, text=True)
        commit = ["git", "-C", folder, "commit", "-q", "-m", message, "--", name]
        done = subprocess.run(commit, capture_output=True, text=True) if add.returncode == 0 else add
        if done.returncode == 0:
            return
        error = (done.stderr or done.stdout).strip()
        time.sleep(2 + 3 * attempt)
    logger.warning("Could not commit %s (%s); commit it by hand.", path, error or "the git index stayed busy")


def claim_run(results_dir: str, label: str) -> str | None:
    """A lock file for the run ``label`` (its holder's pid inside), or ``None`` when a live process holds it: workers
    side by side split the pending runs this way, and a killed worker's lock is taken over."""
    path = os.path.join(results_dir, "locks", f"{label}.lock")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                with open(path, encoding="utf-8") as f:
                    pid = int(f.read().strip() or 0)
                os.kill(pid, 0)
                return None  # a live worker has it
            except PermissionError:
                return None  # alive, another user's process
            except (ValueError, OSError):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)  # a dead worker's lock
                continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return path
    return None


# ------------------------------------------------------------------------------------------------ driver
def run_study(
    config: StudyConfig,
    results_dir: str,
    *,
    command: str = "",
    commit_results: bool = False,
    progress=None,
    rare: bool = True,
) -> list[dict]:
    """Run every run of ``config`` not already in ``results_dir``; return the summaries there (done before or now).

    ``progress``: an optional callable ``(done, total, label, seconds)`` called after each run (for a progress bar);
    ``commit_results``: ``git commit`` each summary as it is written (a study stopped anywhere continues from git).
    Several processes can run the same study side by side: each run is claimed with a lock file first, so every
    run is trained once; a process returns the summaries finished so far (a run another process holds is missing).
    ``rare``: run the rare stage afterwards (the worker processes of a parallel study leave it to the parent).
    """
    if config.threads:
        torch.set_num_threads(config.threads)
    runs = config.runs()
    pending = []
    summaries: dict[str, dict] = {}
    for run in runs:
        existing = _read_summary(summary_path(results_dir, run))
        if existing is not None and existing.get("key") == config.run_key(run):
            summaries[run.label] = existing
        else:
            pending.append(run)
    if progress is not None:
        progress(len(summaries), len(runs), None, 0.0)
    context = None
    for run in pending:
        lock = claim_run(results_dir, run.label)
        if lock is None:
            continue
        try:
            existing = _read_summary(summary_path(results_dir, run))  # another worker may have finished it
            if existing is not None and existing.get("key") == config.run_key(run):
                summaries[run.label] = existing
                continue
            context = context or StudyContext(config)
            summaries[run.label] = _run_one(config, context, run, results_dir, command, commit_results)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(lock)
        if progress is not None:
            progress(len(summaries), len(runs), run.label, summaries[run.label]["wall_seconds"])
    if rare:
        from .rare import rare_stage

        def write(path: str, data: dict) -> None:
            _write_atomic(path, data)
            if commit_results:
                _commit_file(path, f"study {config.name}: rare tail of {os.path.basename(path)[:-5]}")

        rare_stage(config, results_dir, lambda: context or StudyContext(config), write)
    return [summaries[r.label] for r in runs if r.label in summaries]


def _run_one(config: StudyConfig, context: StudyContext, run: RunSpec, results_dir, command, commit_results) -> dict:
    """Train (or, for ``initial``, only evaluate) one run and write its summary."""
    start = time.perf_counter()
    torch.manual_seed(run.seed)
    if run.method == "initial":
        result = {"evals": [{"updates": 0, **evaluate_policy(context, context.model, run.seed)}]}
    else:
        result = _train(context, run, results_dir)
    summary = {
        "key": config.run_key(run),
        "run": {"method": run.method, "setting": run.setting, "seed": run.seed, "trainer": run.trainer,
                "options": run.options, "eval_at": run.eval_at},
        "study": config.shared(),
        **result,
        "wall_seconds": time.perf_counter() - start,
        "threads": torch.get_num_threads(),
        "git_commit": _git_commit(),
        "command": command,
    }  # fmt: skip
    path = summary_path(results_dir, run)
    _write_atomic(path, summary)
    if commit_results:
        _commit_file(path, f"study {config.name}: {run.label} ({summary['wall_seconds']:.0f} s)")
    return summary
