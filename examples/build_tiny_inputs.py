"""Write the inputs of the tiny example configs in `examples/`: a tiny policy, reward model and distillation teacher,
64 prompts, the toy prompt "This man is a", and small preference / unpaired / SFT / process-reward datasets
(offline, ~1 s).

    python examples/build_tiny_inputs.py     # -> outputs/tiny/
    accelerate launch recipes/ppo.py --config examples/ppo_tiny.yaml
    accelerate launch recipes/proposal.py --config examples/proposal_toy.yaml
    accelerate launch recipes/dpo.py --config examples/dpo_tiny.yaml      # likewise kto, sft, reward, kd, prm

The models come from trl_ext's offline kit (`trl_ext.testing`): 2-layer GPT-NeoX networks with random weights and a
locally trained 774-token BPE tokenizer, so the run exercises the whole pipeline but learns nothing meaningful.
"""

from __future__ import annotations

import argparse
import os

from trl_ext import testing as kit


def build(root: str | os.PathLike = "outputs/tiny") -> dict[str, str]:
    """Save the policy and reward folders and the prompt files under `root`; return their paths."""
    tokenizer = kit.build_tokenizer()
    paths = {
        "policy": os.path.join(root, "policy"),
        "reward": os.path.join(root, "reward"),
        "prompts": os.path.join(root, "prompts.jsonl"),
        "toy_prompts": os.path.join(root, "toy_prompts.jsonl"),
        "teacher": os.path.join(root, "teacher"),
        "preferences": os.path.join(root, "preferences.jsonl"),
        "unpaired": os.path.join(root, "unpaired.jsonl"),
        "sft": os.path.join(root, "sft.jsonl"),
        "prm": os.path.join(root, "prm.jsonl"),
    }
    kit.save_tiny_model(kit.build_causal_lm("gpt_neox", tokenizer=tokenizer), tokenizer, paths["policy"])
    kit.save_tiny_model(kit.build_sequence_classifier("gpt_neox", tokenizer=tokenizer), tokenizer, paths["reward"])
    kit.prompt_dataset(n=64).to_json(paths["prompts"])
    kit.harmful_prompt_dataset().to_json(paths["toy_prompts"])  # 16 copies of "This man is a"
    kit.save_tiny_model(kit.build_causal_lm("gpt_neox", tokenizer=tokenizer, seed=1), tokenizer, paths["teacher"])
    kit.preference_dataset(n=64).to_json(paths["preferences"])
    kit.unpaired_preference_dataset(n=64).to_json(paths["unpaired"])
    kit.prompt_completion_dataset(n=64).to_json(paths["sft"])
    kit.prm_dataset(n=64).to_json(paths["prm"])
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/tiny", help="folder to write into (default: outputs/tiny)")
    for name, path in build(parser.parse_args().out).items():
        print(f"{name:<8} {path}")
