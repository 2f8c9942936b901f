"""The reward-model server (`trl_ext.serving`, `recipes/serve_rm.py`).

The app is exercised in-process with FastAPI's test client (good and bad requests, truncation, normalisation, model
failures, Host / API-key / content-type checks), then for real: uvicorn on a free loopback port in a background
thread, probed with `http.client` on one keep-alive connection (each bad request, then a valid one on the same
socket), held busy to get 503s and 408s, queried by the client `RemoteReward` (also concurrently and through
`as_reward_function(url)`), and the recipe with its tiny example YAML in a subprocess. The soak (`-m slow`) runs
`bench/serve_rm_load.py --soak` and checks its figures.
"""

from __future__ import annotations

import http.client
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
from online_helpers import EXAMPLES, RECIPES, REPO, assert_help_lists, load_script, subprocess_env

from trl_ext import testing as kit
from trl_ext.models import (
    RemoteReward,
    RemoteRewardError,
    as_reward_function,
    get_sequence_scores,
    set_reward_normalization,
)
from trl_ext.serving import create_app, is_loopback_host, parse_reward_request, redact_url, serve

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

    base_url = kwargs.pop("base_url", "http://127.0.0.1")  # TestClient's default host, "testserver", gets 403
    return TestClient(create_app(model, tokenizer, **kwargs), base_url=base_url, raise_server_exceptions=False)


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

    reply = client.post("/get_reward", content=chunks(), headers={"Content-Type": "application/json"})
    assert reply.status_code == 413 and "exceeds 256 bytes" in reply.json()["detail"]
    assert reply.headers["connection"] == "close"


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


# ------------------------------------------------------------------------------------- truncation, limits, access
def test_long_texts_are_cut_by_characters_before_tokenising(reward_model, monkeypatch):
    """A text far over ``max_len × max_chars_per_token`` characters reaches the tokenizer already cut to that bound,
    and scores as the whole text cut by tokens would (left: its end, right: its start)."""
    model, tokenizer = reward_model
    text = " ".join(TEXTS) * 2000  # ~470k characters
    expected = {
        "left": local_scores(model, tokenizer, [text], keep=lambda ids: ids[-16:]),
        "right": local_scores(model, tokenizer, [text], keep=lambda ids: ids[:16]),
    }
    seen: list[int] = []
    call = type(tokenizer).__call__

    def spy(self, text, *args, **kwargs):
        seen.extend(len(t) for t in (text if isinstance(text, list) else [text]))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", spy)
    for side in ("left", "right"):
        client = client_for(model, tokenizer, max_len=16, max_chars_per_token=32, truncation_side=side)
        seen.clear()
        reply = client.post("/get_reward", json={"query": [text, "x" * 3_500_000]})  # under the 4 MB limit
        assert reply.status_code == 200, reply.text
        assert seen == [16 * 32, 16 * 32]  # both texts were cut before tokenising, to 512 characters
        assert reply.json()["rewards"][0] == pytest.approx(expected[side][0], abs=1e-5)
    assert client.get("/health").json()["max_chars"] == 512


def test_max_text_chars_refuses_longer_texts(reward_model):
    client = client_for(*reward_model, max_text_chars=10)
    assert client.post("/get_reward", json={"query": ["0123456789"]}).status_code == 200
    reply = client.post("/get_reward", json={"query": ["short", "01234567890"]})
    assert reply.status_code == 413 and "query[1] has 11 characters" in reply.json()["detail"]


@pytest.mark.parametrize(
    ("content_type", "status"),
    [("application/json", 200), ("application/json; charset=utf-8", 200), ("text/plain", 415), (None, 415),
     ("application/x-www-form-urlencoded", 415)],
)  # fmt: skip
def test_json_content_type_is_required(reward_model, content_type, status):
    headers = {} if content_type is None else {"Content-Type": content_type}
    reply = client_for(*reward_model).post("/get_reward", content=b'{"query": ["a"]}', headers=headers)
    assert reply.status_code == status, reply.text
    if status == 415:
        assert "Content-Type: application/json" in reply.json()["detail"]


@pytest.mark.parametrize(
    ("host", "allowed_hosts", "status"),
    [
        ("127.0.0.1:5000", None, 200),
        ("localhost", None, 200),
        ("[::1]:5000", None, 200),
        ("evil.example", None, 403),  # DNS rebinding: a page of evil.example resolved to 127.0.0.1
        ("testserver", None, 403),
        ("0.0.0.0:5000", ["0.0.0.0"], 403),  # a bind address is never an allowed name
        ("rm.internal:5000", ["rm.internal"], 200),
        ("anything.example", ["*"], 200),
    ],
)
def test_host_header_must_be_allowed(reward_model, host, allowed_hosts, status):
    client = client_for(*reward_model, allowed_hosts=allowed_hosts, base_url=f"http://{host}")
    reply = client.post("/get_reward", json={"query": ["a"]})
    assert reply.status_code == status, reply.text
    assert client.get("/health").status_code == status
    if status == 403:
        assert "not allowed" in reply.json()["detail"] and "--allowed_hosts" in reply.json()["detail"]


def test_health_reveals_no_filesystem_path(reward_model):
    model, tokenizer = reward_model
    model.config._name_or_path = "/home/alice/secret-models/rm-v3"
    health = client_for(model, tokenizer).get("/health")
    assert health.status_code == 200
    assert "secret-models" not in health.text and "/home" not in health.text and "name_or_path" not in health.json()


def test_api_key_is_required_when_set(reward_model):
    client = client_for(*reward_model, api_key="s3cret-key")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-key"}):
        reply = client.post("/get_reward", json={"query": ["a"]}, headers=headers)
        assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in reply.json()["detail"] and "s3cret" not in reply.text
    assert client.get("/health").status_code == 401
    good = {"Authorization": "Bearer s3cret-key"}
    assert client.post("/get_reward", json={"query": ["a"]}, headers=good).status_code == 200
    assert client.get("/health", headers=good).json()["auth"] == "bearer"


def test_remote_reward_redacts_credentials_in_logs(caplog):
    port = free_port()  # nobody listens there: every attempt fails and is logged
    url = f"http://alice:pa55word@127.0.0.1:{port}/get_reward?api_key=k3y-value&x=1"
    remote = RemoteReward(url, timeout=2, retries=1, backoff=0.01)
    assert remote.headers["Authorization"].startswith("Basic ")  # the URL's credentials are sent, not resolved
    with caplog.at_level(logging.WARNING, logger="trl_ext.models.reward_functions"):
        with pytest.raises(RemoteRewardError) as err:
            remote(["a"], ["b"])
    shown = caplog.text + str(err.value)
    assert "attempt 1 failed" in caplog.text and f"***@127.0.0.1:{port}" in shown and "api_key=***" in shown
    for secret in ("alice", "pa55word", "k3y-value"):
        assert secret not in shown


def test_redact_url():
    assert redact_url("https://u:p@h:1/p?token=t&sig=s&q=1") == "https://***@h:1/p?token=***&sig=***&q=1"
    assert redact_url("http://127.0.0.1:5000/get_reward") == "http://127.0.0.1:5000/get_reward"


# ------------------------------------------------------------------------------------------------- live server
@pytest.fixture
def start_server(reward_model):
    """``start(**create_app_kwargs) -> (base_url, app)``: the app served by uvicorn on a free loopback port in a
    background thread (the fixture's tiny model unless ``model=``/``tokenizer=`` are given); stopped at teardown."""
    import uvicorn

    running = []

    def start(model=None, tokenizer=None, **kwargs):
        kwargs = {"batch_size": 4, "max_request_items": 64, **kwargs}
        app = create_app(model or reward_model[0], tokenizer or reward_model[1], **kwargs)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        running.append((server, thread))
        deadline = time.time() + 20
        while not server.started:
            assert time.time() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{port}", app

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def live_server(start_server, reward_model):
    """``(url, model, tokenizer)`` of a started server with the default limits."""
    url, _ = start_server()
    return url, *reward_model


def post(conn: http.client.HTTPConnection, body: bytes, content_type: str | None = "application/json", headers=None):
    """``(status, JSON reply, response)`` of ``POST /get_reward`` on the connection ``conn``."""
    headers = {**({"Content-Type": content_type} if content_type else {}), **(headers or {})}
    conn.request("POST", "/get_reward", body=body, headers=headers)
    reply = conn.getresponse()
    return reply.status, json.loads(reply.read()), reply


VALID = json.dumps({"query": ["Question: hi Answer: hello"]}).encode()
PROBES = [  # the failed probes of issue 22 and their neighbours: (id, body, content type, status, message)
    ("3.9 MB text", json.dumps({"query": ["the cat sat " * 325_000]}).encode(), "application/json", 200, None),
    ("4301-digit integer", b'{"query": [' + b"1" * 4301 + b"]}", "application/json", 400, "number too long"),
    ("100k-deep nesting", b"[" * 100_000 + b"]" * 100_000, "application/json", 400, "nested too deeply"),
    ("lone surrogate", b'{"query": ["\\ud800abc"]}', "application/json", 422, "lone surrogate"),
    ("broken JSON", b'{"query": ["a"', "application/json", 400, "not valid JSON"),
    ("not UTF-8", b'{"query": ["\xff"]}', "application/json", 400, "UTF-8"),
    ("text/plain", VALID, "text/plain", 415, "application/json"),
    ("no content type", VALID, None, 415, "application/json"),
    ("too many texts", json.dumps({"query": ["a"] * 65}).encode(), "application/json", 413, "at most 64"),
    ("empty text", b'{"query": [""]}', "application/json", 422, "empty strings"),
]


@pytest.mark.parametrize(
    ("body", "content_type", "status", "message"), [p[1:] for p in PROBES], ids=[p[0] for p in PROBES]
)
def test_each_probe_gets_its_status_and_the_connection_stays_usable(live_server, body, content_type, status, message):
    url, _, _ = live_server
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    try:
        got, reply, _ = post(conn, body, content_type)
        assert got == status, reply
        if message is None:
            assert len(reply["rewards"]) == 1
        else:
            assert message in reply["detail"]
        sock = conn.sock
        assert sock is not None  # the server kept the connection open ...
        got, reply, _ = post(conn, VALID)
        assert got == 200 and len(reply["rewards"]) == 1
        assert conn.sock is sock  # ... and answered the next request on it
    finally:
        conn.close()


def test_a_body_over_the_limit_is_refused_before_it_is_read(start_server):
    url, _ = start_server(max_body_bytes=1000)
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    status, reply, response = post(conn, json.dumps({"query": ["x" * 2000]}).encode())
    assert status == 413 and "at most 1000" in reply["detail"] and response.getheader("connection") == "close"
    conn.close()


def test_a_full_server_answers_503_and_recovers(start_server, reward_model):
    """One request scoring (held inside the model), one waiting: with max_concurrency=1 and max_queue=1 the third
    gets 503 with Retry-After at once; /health still answers; both held requests finish with 200."""
    model, tokenizer = reward_model
    entered, release = threading.Event(), threading.Event()
    forward = model.gpt_neox.forward

    def held(*args, **kwargs):
        entered.set()
        release.wait(30)
        return forward(*args, **kwargs)

    model.gpt_neox.forward = held
    url, app = start_server(max_concurrency=1, max_queue=1)
    host = url.removeprefix("http://")
    statuses: dict[str, int] = {}

    def send(name: str) -> None:
        conn = http.client.HTTPConnection(host, timeout=60)
        statuses[name] = post(conn, VALID)[0]
        conn.close()

    threads = [threading.Thread(target=send, args=(name,)) for name in ("scoring", "waiting")]
    try:
        threads[0].start()
        assert entered.wait(20), "the first request never reached the model"
        threads[1].start()
        deadline = time.time() + 20
        while app.state.admission.in_flight < 2:
            assert time.time() < deadline, "the second request was not admitted"
            time.sleep(0.01)
        conn = http.client.HTTPConnection(host, timeout=20)
        status, reply, response = post(conn, VALID)
        assert status == 503 and "busy" in reply["detail"] and response.getheader("retry-after") == "1"
        conn.request("GET", "/health")
        health = json.loads(conn.getresponse().read())
        assert health["in_flight"] == 2 and (health["max_concurrency"], health["max_queue"]) == (1, 1)
        conn.close()
    finally:
        release.set()
        for thread in threads:
            thread.join(timeout=30)
    assert statuses == {"scoring": 200, "waiting": 200}
    assert app.state.admission.in_flight == 0


def test_a_slow_body_gets_408(start_server):
    url, _ = start_server(body_timeout=0.5)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(
            b"POST /get_reward HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"query": ["'
        )  # ... and nothing more
        reply = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408 ") and b"within 0.5 s" in reply


def test_remote_reward_sends_the_api_key(start_server, monkeypatch):
    url, _ = start_server(api_key="k3y")
    monkeypatch.delenv("TRL_EXT_RM_API_KEY", raising=False)
    with pytest.raises(RemoteRewardError, match="HTTP 401"):
        RemoteReward(f"{url}/get_reward", timeout=10, retries=0)(["a"], ["b"])
    assert RemoteReward(f"{url}/get_reward", timeout=10, retries=0, api_key="k3y")(["a"], ["b"]).shape == (1,)
    monkeypatch.setenv("TRL_EXT_RM_API_KEY", "k3y")
    assert RemoteReward(f"{url}/get_reward", timeout=10, retries=0)(["a"], ["b"]).shape == (1,)


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
        assert "no authentication" in caplog.text and "remote clients get 403" in caplog.text
        caplog.clear()
        serve(create_app(*reward_model, api_key="k", allowed_hosts=["rm.internal"]), host="0.0.0.0", max_connections=9)
        assert not caplog.records  # a key and a host name: nothing to warn about
    assert [c["host"] for c in calls] == ["127.0.0.1", "0.0.0.0", "0.0.0.0"]
    assert [c["limit_concurrency"] for c in calls] == [512, 512, 9]
    assert is_loopback_host("localhost") and is_loopback_host("::1") and not is_loopback_host("10.0.0.1")


def test_missing_fastapi_names_the_serve_extra(monkeypatch, reward_model):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` now fails
    with pytest.raises(ImportError, match=r"trl_ext\[serve\]"):
        create_app(*reward_model)


# ----------------------------------------------------------------------------------------------------- recipe
def test_recipe_help_lists_the_options():
    assert_help_lists(RECIPE, (
        "--config", "--reward_model_path", "--host", "--port", "--batch_size", "--max_len", "--truncation_side",
        "--normalize", "--mean", "--std", "--max_request_items", "--max_body_bytes", "--max_chars_per_token",
        "--max_text_chars", "--max_concurrency", "--max_queue", "--body_timeout", "--allowed_hosts", "--api_key",
        "--max_connections", "TRL_EXT_RM_API_KEY",
    ))  # fmt: skip


def test_recipe_serves_the_tiny_example(tiny_workdir):
    """`python recipes/serve_rm.py --config examples/serve_rm_tiny.yaml --port <free>`, as documented, answers
    RemoteReward with the scores of the reward model it loaded; with `TRL_EXT_RM_API_KEY` set it needs the key."""
    from trl_ext.models import load_reward_model

    port = free_port()
    cmd = [sys.executable, str(RECIPE), "--config", str(TINY_YAML), "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        cwd=tiny_workdir,
        env=subprocess_env(TRL_EXT_RM_API_KEY="recipe-key"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    key = {"Authorization": "Bearer recipe-key"}
    try:
        deadline, health = time.time() + 90, None
        while health is None:
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "the server did not come up"
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/health", headers=key)
                with urllib.request.urlopen(request, timeout=2) as reply:
                    health = json.loads(reply.read())
            except OSError:
                time.sleep(0.2)
        assert health["max_len"] == 256 and health["truncation_side"] == "left" and health["auth"] == "bearer"
        model, tokenizer = load_reward_model(tiny_workdir / "outputs" / "tiny" / "reward")
        with pytest.raises(RemoteRewardError, match="HTTP 401"):
            RemoteReward(f"http://127.0.0.1:{port}/get_reward", timeout=10, retries=0, api_key="")(["a"], ["b"])
        remote = RemoteReward(f"http://127.0.0.1:{port}/get_reward", timeout=10, retries=0, api_key="recipe-key")
        expected = local_scores(model, tokenizer, TEXTS)
        assert remote(TEXTS, [""] * len(TEXTS)).tolist() == pytest.approx(expected, abs=1e-5)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


# ------------------------------------------------------------------------------------------------------- soak
SOAK_RSS_GROWTH_MB = 200  # stated bound on the server RSS after the soak minus after its warm-up (measured: +50-60)


@pytest.mark.slow
def test_soak_mixed_clients():
    """`bench/serve_rm_load.py --soak` at a bounded size: 1500 valid requests from 32 threads while 2 clients send
    3.9 MB texts, 2 send malformed requests (each followed by a valid one on the same connection) and 2 trickle their
    body past the 2 s body timeout. Every valid request gets its rewards, every adversarial request its expected
    reply, and the server's memory after the run is within SOAK_RSS_GROWTH_MB of its memory after the warm-up."""
    bench = load_script(REPO / "bench" / "serve_rm_load.py")
    result = bench.main(["--soak", "--requests", "1500", "--concurrency", "32"])
    print(
        f"soak: {result['requests']} valid requests, {result['errors']} errors, p50 {result['p50_ms']:.0f} ms, "
        f"p99 {result['p99_ms']:.0f} ms; adversarial {result['adversary_replies']}; RSS {result['rss_before_mb']:.0f}"
        f" -> {result['rss_after_mb']:.0f} MB (peak {result['rss_peak_mb']:.0f} MB)"
    )
    assert result["errors"] == 0, result["first_errors"]
    assert result["adversary_unexpected"] == 0, result["first_unexpected"]
    kinds = {key.split(" ")[0].split("/")[0] for key in result["adversary_replies"]}
    assert kinds == {"oversized", "malformed", "slow"}
    assert result["adversary_replies"].get("slow 408", 0) >= 1
    assert result["rss_after_mb"] - result["rss_before_mb"] < SOAK_RSS_GROWTH_MB
