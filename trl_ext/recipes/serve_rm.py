"""Serve a reward model over HTTP (FastAPI + uvicorn: `pip install 'trl_ext[serve]'`).

    python recipes/serve_rm.py --reward_model_path my-reward-model --port 5000
    python recipes/serve_rm.py --config examples/serve_rm_tiny.yaml             # the tiny kit's reward model
    curl -s localhost:5000/get_reward -H 'Content-Type: application/json' \
        -d '{"query": ["Question: hi Answer: hello"]}'                          # -> {"rewards": [...]}

`POST /get_reward` takes `{"query": [full text, ...], "prompts": [prompt, ...]}` (`prompts` optional, checked and not
used: the reward model scores the full text) and returns `{"rewards": [...]}`; `GET /health` describes the model.
A trainer uses the server as its reward with `reward_model="http://127.0.0.1:5000/get_reward"`.

The server binds 127.0.0.1 unless `--host` says otherwise, answers only requests whose Host header is localhost,
127.0.0.1, ::1, the bound host or one of `--allowed_hosts` (403 otherwise), and needs `Authorization: Bearer KEY` when
an API key is set (`TRL_EXT_RM_API_KEY=KEY` in the environment, or `--api_key KEY`; 401 otherwise). Binding another
address without a key is warned about. Long texts are cut to `--max_len × --max_chars_per_token` characters, then to
`--max_len` tokens, from the left (the end of the response is kept) unless `--truncation_side right`.
`--normalize --mean M --std S` replies `(r - M) / S`. Requests are limited to `--max_request_items` texts,
`--max_body_bytes` bytes and optionally `--max_text_chars` characters a text (HTTP 413 above); `--max_concurrency`
requests are scored at once and `--max_queue` more wait (HTTP 503 beyond); a body must arrive within
`--body_timeout` seconds (408).
"""

import logging
import os
from dataclasses import dataclass, field

from trl_ext import cli

API_KEY_ENV = "TRL_EXT_RM_API_KEY"


@dataclass
class ServeRewardModelArguments:
    """Options of the reward-model server.

    Parameters:
        > Model

        reward_model_path, tokenizer_name_or_path, value_head_prefix, lora_path, dtype, device

        > Scoring

        batch_size, max_len, truncation_side, max_chars_per_token, normalize, mean, std

        > Server

        host, port, allowed_hosts, api_key, max_request_items, max_body_bytes, max_text_chars, max_concurrency,
        max_queue, body_timeout, max_connections, log_level
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
    max_chars_per_token: int = field(
        default=32,
        metadata={"help": "Texts are cut to max_len x this many characters before tokenising (bounds the work)."},
    )
    normalize: bool = field(default=False, metadata={"help": "Reply (reward - mean) / std instead of the reward."})
    mean: float = field(default=0.0, metadata={"help": "Mean used by --normalize."})
    std: float = field(default=1.0, metadata={"help": "Standard deviation used by --normalize."})
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "Address to bind. Anything but loopback without an API key is warned about."},
    )
    port: int = field(default=5000, metadata={"help": "Port to listen on."})
    allowed_hosts: list[str] | None = field(
        default=None,
        metadata={
            "help": "Host header names answered besides localhost, 127.0.0.1, ::1 and --host (others: HTTP 403); "
            "'*' answers any."
        },
    )
    api_key: str | None = field(
        default=None,
        metadata={
            "help": f"Require 'Authorization: Bearer KEY' (else HTTP 401). Default: ${API_KEY_ENV} if set; prefer "
            "the environment variable (a flag shows in the process list)."
        },
    )
    max_request_items: int = field(default=1024, metadata={"help": "Most texts per request (more: HTTP 413)."})
    max_body_bytes: int = field(default=4_000_000, metadata={"help": "Largest request body (more: HTTP 413)."})
    max_text_chars: int | None = field(
        default=None,
        metadata={"help": "Longest text in characters (more: HTTP 413). Default: no limit, long texts are cut."},
    )
    max_concurrency: int = field(default=4, metadata={"help": "Requests parsed, tokenised and scored at once."})
    max_queue: int = field(
        default=64, metadata={"help": "Further requests admitted to wait (more: HTTP 503 with Retry-After)."}
    )
    body_timeout: float = field(default=30.0, metadata={"help": "Seconds a client has to send its body (HTTP 408)."})
    max_connections: int = field(
        default=512, metadata={"help": "Most open connections (uvicorn's limit_concurrency; more: HTTP 503)."}
    )
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
        max_chars_per_token=args.max_chars_per_token,
        max_text_chars=args.max_text_chars,
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        body_timeout=args.body_timeout,
        allowed_hosts=[*(args.allowed_hosts or []), args.host],
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
    )


def main(args: ServeRewardModelArguments) -> None:
    from trl_ext.serving import serve

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = build_app(args)
    print(f"Serving {args.reward_model_path} on http://{args.host}:{args.port}/get_reward", flush=True)
    serve(app, host=args.host, port=args.port, log_level=args.log_level, max_connections=args.max_connections)


def make_parser():
    """The recipe's argument parser (`--config file.yaml` supported)."""
    return cli.make_parser((ServeRewardModelArguments,), "Serve a reward model over HTTP (POST /get_reward).")


if __name__ == "__main__":
    (script_args,) = make_parser().parse_args_and_config()
    main(script_args)
