"""The reward-model server (`trl_ext.serving`, `recipes/serve_rm.py`).

The app is exercised in-process with FastAPI's test client (good and bad requests, truncation, normalisation, model
failures), then for real: uvicorn on a free loopback port in a background thread, queried by the existing client
`RemoteReward` (also concurrently and through `as_reward_function(url)`), and the recipe with its tiny example YAML
in a subprocess.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from online_helpers import EXAMPLES, RECIPES, assert_help_lists, subprocess_env

from trl_ext import testing as kit
from trl_ext.models import (
    RemoteReward,
    RemoteRewardError,
    as_reward_function,
    get_sequence_scores,
    set_reward_normalization,
)
from trl_ext.serving import create_app, is_loopback_host, parse_reward_request, serve

pytest.importorskip("fastapi", reason="install trl_ext[serve] to test the reward server")
pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")

RECIPE = RECIPES / "serve_rm.py"
TINY_YAML = EXAMPLES / "serve_rm_tiny.yaml"
TEXTS = [
    "Question: how are you? Answer: fine, thanks.",
    "hi",
    "The cat sat on the mat and then it went to sleep for a very long time, dreaming of fish.",
    "Question: what is two plus two? Answer: four",
    "a b c",
]


@pytest.fixture
def reward_model():
    tokenizer = kit.build_tokenizer()
    return kit.build_sequence_classifier("gpt_neox", tokenizer=tokenizer), tokenizer


def local_scores(model, tokenizer, texts, keep=None) -> list[float]:
    """Each text scored alone, unpadded (``keep(ids)`` may cut its token ids first)."""
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        ids = keep(ids) if keep is not None else ids
        t = torch.tensor([ids])
        with torch.no_grad():
            out.append(get_sequence_scores(model, t, torch.ones_like(t)).item())
    return out


def client_for(model, tokenizer, **kwargs):
    from fastapi.testclient import TestClient

    return TestClient(create_app(model, tokenizer, **kwargs), raise_server_exceptions=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- good requests
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_rewards_equal_local_scores_of_the_same_texts(reward_model, padding_side):
    model, tokenizer = reward_model
    tokenizer.padding_side = padding_side
    client = client_for(model, tokenizer, batch_size=2)  # 5 texts of different lengths: 3 padded batches
    reply = client.post("/get_reward", json={"query": TEXTS})
    assert reply.status_code == 200, reply.text
    rewards = reply.json()["rewards"]
    assert rewards == pytest.approx(local_scores(model, tokenizer, TEXTS), abs=1e-5)
    assert len(set(rewards)) == len(TEXTS)  # the texts really get different scores (the order is checked above)

    with_prompts = client.post("/get_reward", json={"query": TEXTS, "prompts": [t[:5] for t in TEXTS]})
    assert with_prompts.json()["rewards"] == pytest.approx(rewards, abs=1e-6)  # prompts are checked, not used


def test_truncation_keeps_the_end_by_default_or_the_start(reward_model):
    model, tokenizer = reward_model
    text = TEXTS[2]
    assert len(tokenizer(text)["input_ids"]) > 6
    left = client_for(model, tokenizer, max_len=6).post("/get_reward", json={"query": [text]}).json()["rewards"]
    right = client_for(model, tokenizer, max_len=6, truncation_side="right")
    right = right.post("/get_reward", json={"query": [text]}).json()["rewards"]
    assert left == pytest.approx(local_scores(model, tokenizer, [text], keep=lambda ids: ids[-6:]), abs=1e-5)
    assert right == pytest.approx(local_scores(model, tokenizer, [text], keep=lambda ids: ids[:6]), abs=1e-5)
    assert left != pytest.approx(right, abs=1e-4)
    full = local_scores(model, tokenizer, [text])
    assert left != pytest.approx(full, abs=1e-4)  # the cut really changed what was scored


def test_normalisation_replies_standardised_scores(reward_model):
    model, tokenizer = reward_model
    raw = client_for(model, tokenizer).post("/get_reward", json={"query": TEXTS}).json()["rewards"]
    client = client_for(model, tokenizer, normalize=True, mean=0.5, std=4.0)
    normed = client.post("/get_reward", json={"query": TEXTS}).json()["rewards"]
    assert normed == pytest.approx([(r - 0.5) / 4.0 for r in raw], abs=1e-6)
    assert client.get("/health").json()["normalize"] is True


def test_normalisation_settings_are_checked(reward_model):
    model, tokenizer = reward_model
    with pytest.raises(ValueError, match="std > 0"):
        create_app(model, tokenizer, normalize=True, std=0.0)
    set_reward_normalization(model, 1.0, 2.0)  # the model normalises by itself now
    with pytest.raises(ValueError, match="second normalisation"):
        create_app(model, tokenizer, normalize=True, mean=1.0, std=2.0)
    with pytest.raises(ValueError, match="truncation_side"):
        create_app(model, tokenizer, truncation_side="middle")
    tokenizer.pad_token = None
    with pytest.raises(ValueError, match="pad token"):
        create_app(model, tokenizer)


def test_health_describes_the_model_and_counts_requests(reward_model):
    model, tokenizer = reward_model
    client = client_for(model, tokenizer, batch_size=3, max_len=64, max_request_items=10)
    client.post("/get_reward", json={"query": TEXTS[:2]})
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["model"] == "GPTNeoXForSequenceClassification"
    assert (health["batch_size"], health["max_len"], health["max_request_items"]) == (3, 64, 10)
    assert health["served"] == {"requests": 1, "texts": 2, "errors": 0}


# ----------------------------------------------------------------------------------------------- bad requests
BAD_REQUESTS = [
    ("malformed JSON", b'{"query": ["a"', 400, "not valid JSON"),
    ("not UTF-8", b'{"query": ["\xff"]}', 400, "UTF-8"),
    ("not an object", b'["a", "b"]', 422, "JSON object"),
    ("no query", b'{"texts": ["a"]}', 422, 'no "query"'),
    ("query a string", b'{"query": "a"}', 422, "send a list of strings"),
    ("query a number", b'{"query": 3}', 422, "must be a list of strings"),
    ("empty list", b'{"query": []}', 422, "is empty"),
    ("non-string item", b'{"query": ["a", 7]}', 422, "query[1] is int"),
    ("null item", b'{"query": ["a", null]}', 422, "query[1] is NoneType"),
    ("empty string", b'{"query": ["a", ""]}', 422, "empty strings"),
    ("too many items", json.dumps({"query": ["a"] * 9}).encode(), 413, "at most 8"),
    ("prompts not a list", b'{"query": ["a"], "prompts": "a"}', 422, '"prompts" must be a list'),
    ("prompts of another length", b'{"query": ["a"], "prompts": ["a", "b"]}', 422, "one prompt per query"),
    ("non-string prompt", b'{"query": ["a"], "prompts": [1]}', 422, "prompts[0] is int"),
    ("body too large", json.dumps({"query": ["x" * 300]}).encode(), 413, "at most 256"),
]


@pytest.mark.parametrize(
    ("body", "status", "message"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_requests_get_a_4xx_with_a_message(reward_model, body, status, message):
    model, tokenizer = reward_model
    client = client_for(model, tokenizer, max_request_items=8, max_body_bytes=256)
    reply = client.post("/get_reward", content=body, headers={"Content-Type": "application/json"})
    assert reply.status_code == status, reply.text
    assert message in reply.json()["detail"]


def test_body_limit_holds_without_a_content_length(reward_model):
    """A chunked upload (no Content-Length header) is cut off at the limit too."""
    model, tokenizer = reward_model
    client = client_for(model, tokenizer, max_body_bytes=256)

    def chunks():
        yield b'{"query": ["'
        for _ in range(10):
            yield b"x" * 100
        yield b'"]}'

    reply = client.post("/get_reward", content=chunks())
    assert reply.status_code == 413 and "exceeds 256 bytes" in reply.json()["detail"]


def test_parse_reward_request_returns_the_texts():
    assert parse_reward_request(b'{"query": ["a", "b"], "prompts": null}', max_items=2) == ["a", "b"]


# ---------------------------------------------------------------------------------------------- model failures
def _break(model, nan: bool):
    """Make the tiny reward model fail: its backbone raises an internal-looking error, or its head returns NaN."""
    if nan:
        model.score.forward = lambda hidden: torch.full((*hidden.shape[:-1], 1), float("nan"))
    else:

        def fail(*args, **kwargs):
            raise RuntimeError("CUDA out of memory at /secret/path/model.py line 42")

        model.gpt_neox.forward = fail
    return model


@pytest.mark.parametrize("nan", [False, True], ids=["raises", "nan"])
def test_model_errors_are_a_generic_500_and_logged(reward_model, caplog, nan):
    model, tokenizer = reward_model
    client = client_for(_break(model, nan), tokenizer)
    with caplog.at_level(logging.ERROR, logger="trl_ext.serving.rm_server"):
        reply = client.post("/get_reward", json={"query": ["a"]})
    assert reply.status_code == 500
    body = reply.text
    assert "server log" in reply.json()["detail"]
    for leak in ("secret", "Traceback", "RuntimeError", "nan", "line 42"):
        assert leak not in body
    logged = "\n".join(r.getMessage() + str(r.exc_info) for r in caplog.records)
    assert ("/secret/path" in logged) if not nan else ("non-finite" in logged)
    assert client.get("/health").json()["served"]["errors"] == 1


# ------------------------------------------------------------------------------------------------- live server
@pytest.fixture
def live_server(reward_model):
    """The app served by uvicorn on a free loopback port in a background thread: ``(url, model, tokenizer)``."""
    import uvicorn

    model, tokenizer = reward_model
    port = free_port()
    app = create_app(model, tokenizer, batch_size=4, max_request_items=64)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", model, tokenizer
    server.should_exit = True
    thread.join(timeout=10)


def test_remote_reward_client_against_the_live_server(live_server):
    url, model, tokenizer = live_server
    prompts = ["Question: hi Answer:", "Tell me a story.", "x"]
    completions = [" hello there", " Once upon a time", " y z"]
    remote = RemoteReward(f"{url}/get_reward", timeout=10, retries=0, batch_size=2)
    local = as_reward_function((model, tokenizer))
    torch.testing.assert_close(remote(prompts, completions), local(prompts, completions), atol=1e-5, rtol=0)

    # A trainer's `reward_model="http://..."` goes through as_reward_function: same scores as the local model.
    through_url = as_reward_function(f"{url}/get_reward")
    assert isinstance(through_url, RemoteReward)
    torch.testing.assert_close(through_url(prompts, completions), local(prompts, completions), atol=1e-5, rtol=0)

    with pytest.raises(RemoteRewardError, match="HTTP 422.*empty strings"):
        remote([""], [""])


def test_concurrent_requests_get_their_own_answers(live_server):
    url, model, tokenizer = live_server
    texts = [f"request {i}: " + "word " * (i % 7) for i in range(24)]
    expected = local_scores(model, tokenizer, texts)
    remote = RemoteReward(f"{url}/get_reward", timeout=30, retries=0)
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(lambda i: remote([texts[i]], [""]).item(), range(len(texts))))
    assert got == pytest.approx(expected, abs=1e-5)


def test_serve_warns_when_not_bound_to_loopback(monkeypatch, caplog, reward_model):
    import uvicorn

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append(kw))
    app = create_app(*reward_model)
    with caplog.at_level(logging.WARNING, logger="trl_ext.serving.rm_server"):
        serve(app, host="127.0.0.1", port=5001)
        assert not caplog.records
        serve(app, host="0.0.0.0", port=5002)
    assert [c["host"] for c in calls] == ["127.0.0.1", "0.0.0.0"]
    assert "no authentication" in caplog.text
    assert is_loopback_host("localhost") and is_loopback_host("::1") and not is_loopback_host("10.0.0.1")


def test_missing_fastapi_names_the_serve_extra(monkeypatch, reward_model):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` now fails
    with pytest.raises(ImportError, match=r"trl_ext\[serve\]"):
        create_app(*reward_model)


# ----------------------------------------------------------------------------------------------------- recipe
def test_recipe_help_lists_the_options():
    assert_help_lists(RECIPE, (
        "--config", "--reward_model_path", "--host", "--port", "--batch_size", "--max_len", "--truncation_side",
        "--normalize", "--mean", "--std", "--max_request_items", "--max_body_bytes",
    ))  # fmt: skip


def test_recipe_serves_the_tiny_example(tiny_workdir):
    """`python recipes/serve_rm.py --config examples/serve_rm_tiny.yaml --port <free>`, as documented, answers
    RemoteReward with the scores of the reward model it loaded."""
    from trl_ext.models import load_reward_model

    port = free_port()
    cmd = [sys.executable, str(RECIPE), "--config", str(TINY_YAML), "--port", str(port)]
    proc = subprocess.Popen(
        cmd, cwd=tiny_workdir, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline, health = time.time() + 90, None
        while health is None:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "the server did not come up"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                    health = json.loads(reply.read())
            except OSError:
                time.sleep(0.2)
        assert health["max_len"] == 256 and health["truncation_side"] == "left"
        model, tokenizer = load_reward_model(tiny_workdir / "outputs" / "tiny" / "reward")
        remote = RemoteReward(f"http://127.0.0.1:{port}/get_reward", timeout=10, retries=0)
        expected = local_scores(model, tokenizer, TEXTS)
        assert remote(TEXTS, [""] * len(TEXTS)).tolist() == pytest.approx(expected, abs=1e-5)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
