"""Chat with a causal LM in the terminal, through its chat template.

    python recipes/chat.py --model_name_or_path my-chat-model --temperature 0.7 --max_new_tokens 256
    python recipes/chat.py --model_name_or_path outputs/tiny/policy --system_prompt "Be brief."
    printf 'hello\\nclear\\nhi\\nexit\\n' | python recipes/chat.py --model_name_or_path outputs/tiny/policy

Type a message and press Enter; the reply is printed as `assistant> ...`. `clear` forgets the conversation,
`exit` / `quit` (or Ctrl-D) ends the session. The whole conversation is sent every turn; when it no longer fits the
model's context, the oldest turns are dropped.
"""

import sys
from dataclasses import dataclass, field

from trl_ext import cli


@dataclass
class ChatArguments:
    """Options of the chat.

    Parameters:
        > Model

        model_name_or_path, model_revision, dtype, device, chat_template_file

        > Sampling

        temperature, top_p, top_k, max_new_tokens, system_prompt, seed
    """

    model_name_or_path: str | None = field(default=None, metadata={"help": "Causal LM folder or Hub id."})
    model_revision: str = field(default="main", metadata={"help": "Revision of a Hub model."})
    dtype: str = field(default="float32", metadata={"help": "Load dtype ('float32', 'bfloat16', 'auto')."})
    device: str | None = field(default=None, metadata={"help": "Device (default: cuda when available, else cpu)."})
    chat_template_file: str | None = field(
        default=None, metadata={"help": "A Jinja chat template file, for tokenizers without a template."}
    )
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature (0: greedy)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold (1.0: off)."})
    top_k: int | None = field(default=None, metadata={"help": "Top-k sampling (None: off)."})
    max_new_tokens: int = field(default=256, metadata={"help": "Most tokens per reply."})
    system_prompt: str | None = field(default=None, metadata={"help": "System message placed before the chat."})
    seed: int | None = field(default=None, metadata={"help": "Random seed (None: not seeded)."})

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ValueError("Need --temperature >= 0, 0 < --top_p <= 1 and --max_new_tokens >= 1.")


def build_session(args: ChatArguments):
    """Load the model and its tokenizer and open a `ChatSession`."""
    import torch
    from transformers import AutoTokenizer

    from trl_ext.inference import ChatSession
    from trl_ext.models import load_causal_lm

    if args.model_name_or_path is None:
        raise ValueError("Pass --model_name_or_path (the model to chat with).")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, revision=args.model_revision)
    model = load_causal_lm(args.model_name_or_path, dtype=args.dtype, revision=args.model_revision)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    template = None
    if args.chat_template_file is not None:
        with open(args.chat_template_file) as f:
            template = f.read()
    return ChatSession(
        model,
        tokenizer,
        system_prompt=args.system_prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        chat_template=template,
    )


def main(args: ChatArguments) -> int:
    from trl_ext.inference import run_chat

    session = build_session(args)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chatting with {args.model_name_or_path}. Commands: clear, exit.", file=sys.stderr)
    return run_chat(session, sys.stdin, sys.stdout, prompt="user> " if interactive else None)


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser((ChatArguments,), "Chat with a causal LM through its chat template.")


if __name__ == "__main__":
    (chat_args,) = make_parser().parse_args_and_config()
    main(chat_args)
