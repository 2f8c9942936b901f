"""Write the inputs of `examples/ppo_tiny.yaml` and `examples/proposal_toy.yaml`: a tiny policy, a tiny reward model,
64 prompts and the toy prompt "This man is a" (offline, ~1 s).

    python examples/build_tiny_inputs.py     # -> outputs/tiny/{policy,reward,prompts.jsonl,toy_prompts.jsonl}
    accelerate launch recipes/ppo.py --config examples/ppo_tiny.yaml
    accelerate launch recipes/proposal.py --config examples/proposal_toy.yaml

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
    }
    kit.save_tiny_model(kit.build_causal_lm("gpt_neox", tokenizer=tokenizer), tokenizer, paths["policy"])
    kit.save_tiny_model(kit.build_sequence_classifier("gpt_neox", tokenizer=tokenizer), tokenizer, paths["reward"])
    kit.prompt_dataset(n=64).to_json(paths["prompts"])
    kit.harmful_prompt_dataset().to_json(paths["toy_prompts"])  # 16 copies of "This man is a"
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/tiny", help="folder to write into (default: outputs/tiny)")
    for name, path in build(parser.parse_args().out).items():
        print(f"{name:<8} {path}")
