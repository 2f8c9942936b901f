"""Serve a reward model over HTTP (FastAPI + uvicorn: `pip install 'trl_ext[serve]'`).

    python recipes/serve_rm.py --reward_model_path my-reward-model --port 5000
    python recipes/serve_rm.py --config examples/serve_rm_tiny.yaml             # the tiny kit's reward model
    curl -s localhost:5000/get_reward -d '{"query": ["Question: hi Answer: hello"]}'   # -> {"rewards": [...]}

`POST /get_reward` takes `{"query": [full text, ...], "prompts": [prompt, ...]}` (`prompts` optional, checked and not
used: the reward model scores the full text) and returns `{"rewards": [...]}`; `GET /health` describes the model.
A trainer uses the server as its reward with `reward_model="http://127.0.0.1:5000/get_reward"`.

The server binds 127.0.0.1 unless `--host` says otherwise (it has no authentication: a warning is printed for any
other address). Long texts are cut to `--max_len` tokens from the left (the end of the response is kept) unless
`--truncation_side right`. `--normalize --mean M --std S` replies `(r - M) / S`. Requests are limited to
`--max_request_items` texts and `--max_body_bytes` bytes (HTTP 413 above).
"""

import logging
from dataclasses import dataclass, field

from trl_ext import cli


@dataclass
class ServeRewardModelArguments:
    """Options of the reward-model server.

    Parameters:
        > Model

        reward_model_path, tokenizer_name_or_path, value_head_prefix, lora_path, dtype, device

        > Scoring

        batch_size, max_len, truncation_side, normalize, mean, std

        > Server

        host, port, max_request_items, max_body_bytes, log_level
    """

    reward_model_path: str | None = field(
        default=None,
        metadata={"help": "Reward model folder or Hub id (a 1-label sequence classifier or an OpenRLHF value head)."},
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer to use instead of the reward model's own."}
    )
    value_head_prefix: str | None = field(
        default=None, metadata={"help": "Key prefix of an OpenRLHF-style value head ('value_head', 'score')."}
    )
    lora_path: str | None = field(default=None, metadata={"help": "A LoRA adapter to apply (and merge) first."})
    dtype: str | None = field(
        default=None, metadata={"help": "Load dtype ('float32', 'bfloat16', ...); default float32 on CPU."}
    )
    device: str | None = field(default=None, metadata={"help": "Device of the model ('cpu', 'cuda:0', ...)."})
    batch_size: int = field(default=16, metadata={"help": "Texts per forward pass."})
    max_len: int = field(default=512, metadata={"help": "Texts longer than this many tokens are truncated."})
    truncation_side: str = field(
        default="left",
        metadata={"help": "'left' cuts the start of long texts (keeps the response end), 'right' cuts the end."},
    )
    normalize: bool = field(default=False, metadata={"help": "Reply (reward - mean) / std instead of the reward."})
    mean: float = field(default=0.0, metadata={"help": "Mean used by --normalize."})
    std: float = field(default=1.0, metadata={"help": "Standard deviation used by --normalize."})
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "Address to bind. Anything but loopback exposes the unauthenticated server (warned)."},
    )
    port: int = field(default=5000, metadata={"help": "Port to listen on."})
    max_request_items: int = field(default=1024, metadata={"help": "Most texts per request (more: HTTP 413)."})
    max_body_bytes: int = field(default=4_000_000, metadata={"help": "Largest request body (more: HTTP 413)."})
    log_level: str = field(default="info", metadata={"help": "uvicorn log level (debug, info, warning, error)."})

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be between 1 and 65535; got {self.port}.")
        if self.truncation_side not in ("left", "right"):
            raise ValueError(f"--truncation_side must be 'left' or 'right'; got {self.truncation_side!r}.")


def build_app(args: ServeRewardModelArguments):
    """Load the reward model named by ``args`` and build the app (without serving it)."""
    from trl_ext.models import load_reward_model
    from trl_ext.serving import create_app

    if args.reward_model_path is None:
        raise ValueError("Pass --reward_model_path (a reward model folder or Hub id).")
    model, tokenizer = load_reward_model(
        args.reward_model_path,
        tokenizer=args.tokenizer_name_or_path,
        dtype=args.dtype,
        device=args.device,
        value_head_prefix=args.value_head_prefix,
        lora_path=args.lora_path,
    )
    return create_app(
        model,
        tokenizer,
        batch_size=args.batch_size,
        max_len=args.max_len,
        normalize=args.normalize,
        mean=args.mean,
        std=args.std,
        max_request_items=args.max_request_items,
        max_body_bytes=args.max_body_bytes,
        truncation_side=args.truncation_side,
    )


def main(args: ServeRewardModelArguments) -> None:
    from trl_ext.serving import serve

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = build_app(args)
    print(f"Serving {args.reward_model_path} on http://{args.host}:{args.port}/get_reward", flush=True)
    serve(app, host=args.host, port=args.port, log_level=args.log_level)


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser((ServeRewardModelArguments,), "Serve a reward model over HTTP (POST /get_reward).")


if __name__ == "__main__":
    (script_args,) = make_parser().parse_args_and_config()
    main(script_args)
