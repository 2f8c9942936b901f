"""Merge a LoRA adapter into its base model (causal LM or reward model) and save a plain checkpoint.

    python recipes/merge_lora.py --adapter_path outputs/ppo-lora --output_dir outputs/ppo-merged
    python recipes/merge_lora.py --adapter_path outputs/rm-lora --base_model_name_or_path my-sft-model \\
        --output_dir outputs/rm-merged --model_kind seq_cls --dtype bfloat16
    python recipes/merge_lora.py --adapter_path A --output_dir M --push_to_hub --hub_model_id me/merged

The base comes from the adapter's `base_model_name_or_path` unless `--base_model_name_or_path` is given; the kind of
model from the adapter's `task_type` (`CAUSAL_LM`, `SEQ_CLS`) or the base's architecture unless `--model_kind` is
given. The merged model loads with `AutoModelForCausalLM` / `AutoModelForSequenceClassification.from_pretrained` (or
`trl_ext.models.load_reward_model`) and needs no PEFT.
"""

from dataclasses import dataclass, field

from trl_ext import cli


@dataclass
class MergeLoraArguments:
    """Options of the merge.

    Parameters:
        > Input

        adapter_path, base_model_name_or_path, model_kind, tokenizer_name_or_path, model_revision

        > Output

        output_dir, dtype, push_to_hub, hub_model_id, hub_private
    """

    adapter_path: str | None = field(default=None, metadata={"help": "Folder of the PEFT adapter to merge."})
    base_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model (default: the one recorded in the adapter config)."}
    )
    model_kind: str = field(
        default="auto", metadata={"help": "'auto' (from the adapter's task_type), 'causal_lm' or 'seq_cls'."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer to save (default: the adapter folder's, else the base's)."}
    )
    model_revision: str | None = field(default=None, metadata={"help": "Revision of a Hub base model."})
    output_dir: str | None = field(default=None, metadata={"help": "Where to save the merged model."})
    dtype: str = field(default="auto", metadata={"help": "Dtype to merge and save in ('auto': the checkpoint's)."})
    push_to_hub: bool = field(default=False, metadata={"help": "Also push the merged model to the Hub."})
    hub_model_id: str | None = field(default=None, metadata={"help": "Hub repository id for --push_to_hub."})
    hub_private: bool = field(default=True, metadata={"help": "Create the Hub repository as private."})

    def __post_init__(self):
        if self.model_kind not in ("auto", "causal_lm", "seq_cls"):
            raise ValueError(f"--model_kind must be auto, causal_lm or seq_cls; got {self.model_kind!r}.")
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id (e.g. my-user/my-merged-model).")


def main(args: MergeLoraArguments):
    from trl_ext.inference import merge_lora

    if args.adapter_path is None or args.output_dir is None:
        raise ValueError("Pass --adapter_path (the adapter folder) and --output_dir (where to save the merged model).")
    model = merge_lora(
        args.adapter_path,
        args.output_dir,
        base_model_name_or_path=args.base_model_name_or_path,
        model_kind=args.model_kind,
        dtype=args.dtype,
        tokenizer_name_or_path=args.tokenizer_name_or_path,
        revision=args.model_revision,
        push_to_hub=args.push_to_hub,
        hub_model_id=args.hub_model_id,
        hub_private=args.hub_private,
    )
    print(f"Merged {args.adapter_path} into {type(model).__name__}; saved to {args.output_dir}", flush=True)
    return model


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser((MergeLoraArguments,), "Merge a LoRA adapter into its base model.")


if __name__ == "__main__":
    (merge_args,) = make_parser().parse_args_and_config()
    main(merge_args)
