"""Load and soak test of the reward-model server: concurrent valid `POST /get_reward` requests, optionally mixed
with oversized, malformed and slow clients, against a local server.

    python bench/serve_rm_load.py                                  # 1000 requests, 32 at a time, tiny kit RM
    python bench/serve_rm_load.py --requests 2000 --concurrency 64 --texts-per-request 8
    python bench/serve_rm_load.py --soak                           # + 2 oversized, 2 malformed, 2 slow clients
    python bench/serve_rm_load.py --url http://127.0.0.1:5000/get_reward   # an already running server

Without ``--url`` the script saves the offline kit's tiny reward model (a random 2-layer GPT-NeoX classifier) to a
temporary folder, starts ``recipes/serve_rm.py`` on a free loopback port in a subprocess (so the server and the
client threads do not share a GIL), waits for ``/health`` and then sends ``--requests`` requests from
``--concurrency`` client threads sharing one ``httpx.Client``. Each request carries ``--texts-per-request`` prompt +
response texts from the kit's prompts (5–40 tokens). Every reply is checked: HTTP 200 and one finite reward per
text; anything else counts as an error.

While the valid load runs, adversarial clients (``--soak`` sets 2 of each) loop until it ends:

- oversized: one 3.9 MB text (under the 4 MB body limit) a request; expects 200 (the server cuts it by characters
  before tokenising);
- malformed: on one keep-alive connection, a bad request (4,301-digit integer, 100k-deep nesting, lone surrogate,
  broken JSON, ``text/plain``, empty text, foreign ``Host``) then a valid one; expects the 4xx of each and then a
  200 on the *same* connection;
- slow: sends the headers, then the body one byte every 0.25 s; expects 408 once ``--body-timeout`` has passed.

An adversarial reply other than the expected one (a 500, a dropped connection) counts as ``adversary_unexpected``.

Printed: the errors of the valid requests, their latency percentiles (p50, p90, p99, max) from request start to
reply parsed, the throughput, the adversarial replies by kind and status, and (own server only) the server's resident
memory (RSS) after the warm-up, its peak during the run (sampled every 0.1 s) and after the run. Not a test: nothing
is asserted (``tests/serving/test_rm_server.py::test_soak_mixed_clients`` asserts on the same figures).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(folder: str, port: int, args, log) -> subprocess.Popen:
    """Save the tiny reward model into ``folder`` and serve it on ``port`` (a subprocess of the recipe)."""
    sys.path.insert(0, str(REPO))
    from trl_ext import testing as kit

    tokenizer = kit.build_tokenizer()
    kit.save_tiny_model(kit.build_sequence_classifier("gpt_neox", tokenizer=tokenizer), tokenizer, folder)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": str(args.server_threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("TRL_EXT_RM_API_KEY", None)
    cmd = [
        sys.executable, str(REPO / "recipes" / "serve_rm.py"), "--reward_model_path", folder, "--port", str(port),
        "--batch_size", str(args.batch_size), "--log_level", "warning", "--body_timeout", str(args.body_timeout),
        "--max_concurrency", str(args.max_concurrency), "--max_queue", str(args.max_queue),
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)


def _wait_for_health(client, base: str, server: subprocess.Popen | None, log_path, timeout: float = 180.0) -> dict:
    deadline = time.time() + timeout
    while True:
        if server is not None and server.poll() is not None:
            tail = Path(log_path).read_text()[-3000:] if log_path else ""
            raise RuntimeError(f"The server exited with {server.returncode}:\n{tail}")
        try:
            reply = client.get(f"{base}/health", timeout=2.0)
            if reply.status_code == 200:
                return reply.json()
        except Exception:  # not listening yet
            pass
        if time.time() > deadline:
            raise TimeoutError(f"No healthy server at {base} after {timeout:.0f}s.")
        time.sleep(0.2)


def _texts(n: int, seed: int) -> list[str]:
    sys.path.insert(0, str(REPO))
    from trl_ext import testing as kit

    rng = random.Random(seed)
    prompts = kit.prompt_dataset(n=64)["prompt"]
    words = "the a cat dog house sun rain good bad quick slow red blue tree river".split()
    return [rng.choice(prompts) + " " + " ".join(rng.choices(words, k=rng.randint(2, 20))) for _ in range(n)]


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (Linux ``/proc``; NaN elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_load(url: str, requests: int, concurrency: int, texts_per_request: int, seed: int, client) -> dict:
    """Send the valid requests and return the measurements."""
    pool_texts = _texts(512, seed)
    k = texts_per_request
    payloads = [json.dumps({"query": [pool_texts[(i * k + j) % 512] for j in range(k)]}) for i in range(requests)]
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        body = payloads[i]
        expected = len(json.loads(body)["query"])
        start = time.perf_counter()
        try:
            reply = client.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60.0)
            rewards = reply.json().get("rewards") if reply.status_code == 200 else None
            ok = isinstance(rewards, list) and len(rewards) == expected and all(map(math.isfinite, rewards))
            problem = None if ok else f"HTTP {reply.status_code}: {reply.text[:200]}"
        except Exception as err:  # connection errors, timeouts
            problem = f"{type(err).__name__}: {err}"
        elapsed = time.perf_counter() - start
        with lock:
            latencies.append(elapsed)
            if problem is not None:
                errors.append(problem)

    wall_start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(requests)))
    wall = time.perf_counter() - wall_start
    latencies.sort()
    return {
        "requests": requests,
        "concurrency": concurrency,
        "texts_per_request": texts_per_request,
        "errors": len(errors),
        "first_errors": errors[:5],
        "p50_ms": 1000 * statistics.median(latencies),
        "p90_ms": 1000 * _percentile(latencies, 90),
        "p99_ms": 1000 * _percentile(latencies, 99),
        "max_ms": 1000 * latencies[-1],
        "wall_s": wall,
        "requests_per_s": requests / wall,
        "texts_per_s": requests * texts_per_request / wall,
    }


# -------------------------------------------------------------------------------------------- adversarial clients
JSON = "application/json"
BAD_REQUESTS = [  # (name, body, content type, extra headers, expected status)
    ("4301-digit integer", b'{"query": [' + b"1" * 4301 + b"]}", JSON, {}, 400),
    ("100k-deep nesting", b"[" * 100_000 + b"]" * 100_000, JSON, {}, 400),
    ("lone surrogate", b'{"query": ["\\ud800abc"]}', JSON, {}, 422),
    ("broken JSON", b'{"query": ["a"', JSON, {}, 400),
    ("text/plain", b'{"query": ["a"]}', "text/plain", {}, 415),
    ("empty text", b'{"query": [""]}', JSON, {}, 422),
    ("foreign Host", b'{"query": ["a"]}', JSON, {"Host": "evil.example"}, 403),
]
VALID_BODY = b'{"query": ["Question: hi Answer: hello"]}'


class Adversaries:
    """Oversized, malformed and slow clients looping in threads until :meth:`stop`."""

    def __init__(self, url: str, oversized: int, malformed: int, slow: int, deadline_s: float = 120.0):
        parts = urlsplit(url)
        self.host, self.port, self.path = parts.hostname, parts.port or 80, parts.path or "/"
        self.deadline_s = deadline_s
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.replies: collections.Counter = collections.Counter()
        self.unexpected: list[str] = []
        self.oversized_s: list[float] = []
        words = "the quick brown fox jumps over a lazy dog and keeps running far away ".split()
        text = " ".join(words[i % len(words)] for i in range(700_000))[:3_900_000]
        self.oversized_body = json.dumps({"query": [text]}).encode()
        kinds = [self._oversized] * oversized + [self._malformed] * malformed + [self._slow] * slow
        self.threads = [threading.Thread(target=k, args=(i,), daemon=True) for i, k in enumerate(kinds)]

    def _note(self, kind: str, status, expected) -> None:
        with self.lock:
            self.replies[f"{kind} {status}"] += 1
            if status not in expected:
                self.unexpected.append(f"{kind}: got {status}, expected {sorted(expected)}")

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.deadline_s)

    def _post(self, conn, body: bytes, content_type: str = JSON, headers: dict | None = None) -> int:
        conn.request("POST", self.path, body=body, headers={"Content-Type": content_type, **(headers or {})})
        reply = conn.getresponse()
        reply.read()
        return reply.status

    def _oversized(self, i: int) -> None:
        conn = self._conn()
        while not self.stop_event.is_set():
            start = time.perf_counter()
            try:
                status = self._post(conn, self.oversized_body)
            except Exception as err:  # noqa: BLE001 - every failure is a finding
                status, conn = type(err).__name__, self._conn()
            with self.lock:
                self.oversized_s.append(time.perf_counter() - start)
            self._note("oversized", status, {200})
        conn.close()

    def _malformed(self, i: int) -> None:
        conn, k = self._conn(), i
        while not self.stop_event.is_set():
            name, body, content_type, headers, expected = BAD_REQUESTS[k % len(BAD_REQUESTS)]
            k += 1
            try:
                status = self._post(conn, body, content_type, headers)
                sock = conn.sock
                self._note(f"malformed/{name}", status, {expected})
                after = self._post(conn, VALID_BODY)
                kept = sock is not None and conn.sock is sock
                self._note("malformed/valid after", after if kept else "connection dropped", {200})
            except Exception as err:  # noqa: BLE001
                self._note(f"malformed/{name}", type(err).__name__, {expected})
                conn.close()
                conn = self._conn()
        conn.close()

    def _slow(self, i: int) -> None:
        body = json.dumps({"query": ["a slow client's text"]}).encode().ljust(64)
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: {JSON}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        while not self.stop_event.is_set():
            status = "no reply"
            try:
                with socket.create_connection((self.host, self.port), timeout=self.deadline_s) as sock:
                    sock.sendall(head)
                    sock.settimeout(0.25)
                    reply = b""
                    for byte in range(len(body)):
                        try:
                            reply = sock.recv(4096)
                            break  # the server answered (408) before the body was complete
                        except TimeoutError:
                            sock.sendall(body[byte : byte + 1])
                    sock.settimeout(self.deadline_s)
                    while b"\r\n" not in reply:
                        chunk = sock.recv(4096)
                        if not chunk:
                            break
                        reply += chunk
                    status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else "no reply"
            except (OSError, ValueError) as err:
                status = type(err).__name__
            self._note("slow", status, {408, 200})

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> dict:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=self.deadline_s)
        times = sorted(self.oversized_s)
        return {
            "adversary_replies": dict(sorted(self.replies.items())),
            "adversary_unexpected": len(self.unexpected),
            "first_unexpected": self.unexpected[:5],
            "oversized_p50_ms": 1000 * statistics.median(times) if times else None,
            "oversized_max_ms": 1000 * times[-1] if times else None,
        }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--texts-per-request", type=int, default=4)
    parser.add_argument("--oversized-clients", type=int, default=0, help="clients sending 3.9 MB texts")
    parser.add_argument("--malformed-clients", type=int, default=0, help="clients sending bad requests")
    parser.add_argument("--slow-clients", type=int, default=0, help="clients trickling their body")
    parser.add_argument("--soak", action="store_true", help="2 clients of each adversarial kind (unless set)")
    parser.add_argument("--batch-size", type=int, default=16, help="server --batch_size (own server only)")
    parser.add_argument("--server-threads", type=int, default=1, help="OMP threads of the server (own server only)")
    parser.add_argument("--body-timeout", type=float, default=2.0, help="server --body_timeout (own server only)")
    parser.add_argument("--max-concurrency", type=int, default=4, help="server --max_concurrency (own server only)")
    parser.add_argument("--max-queue", type=int, default=64, help="server --max_queue (own server only)")
    parser.add_argument("--url", default=None, help="an already running /get_reward endpoint (else start one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.soak:
        args.oversized_clients = args.oversized_clients or 2
        args.malformed_clients = args.malformed_clients or 2
        args.slow_clients = args.slow_clients or 2

    import httpx

    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    server, rss = None, {}
    with tempfile.TemporaryDirectory() as folder, httpx.Client(limits=limits) as client:
        log_path = os.path.join(folder, "server.log")
        with open(log_path, "w") as log:
            if args.url is None:
                port = _free_port()
                server = _start_server(os.path.join(folder, "reward"), port, args, log)
                url = f"http://127.0.0.1:{port}/get_reward"
            else:
                url = args.url
            try:
                health = _wait_for_health(client, url.rsplit("/", 1)[0], server, log_path)
                client.post(url, json={"query": ["warm-up text"]}, timeout=60.0)  # first forward pass: lazy init
                peak, sampling = [0.0], threading.Event()
                if server is not None:
                    rss["rss_before_mb"] = rss_mb(server.pid)

                    def sample() -> None:
                        while not sampling.wait(0.1):
                            peak[0] = max(peak[0], rss_mb(server.pid))

                    threading.Thread(target=sample, daemon=True).start()
                adversaries = Adversaries(url, args.oversized_clients, args.malformed_clients, args.slow_clients)
                adversaries.start()
                result = run_load(url, args.requests, args.concurrency, args.texts_per_request, args.seed, client)
                result.update(adversaries.stop())
                sampling.set()
                if server is not None:
                    time.sleep(0.5)
                    rss.update(rss_peak_mb=max(peak[0], rss_mb(server.pid)), rss_after_mb=rss_mb(server.pid))
            finally:
                if server is not None:
                    server.terminate()
                    server.wait(timeout=30)
    result.update(rss, model=health.get("model"), server_batch_size=health.get("batch_size"))
    result["load"] = os.getloadavg()[0]
    adversarial = args.oversized_clients + args.malformed_clients + args.slow_clients
    print(f"server: {health.get('model')} at {url} (batch_size {health.get('batch_size')})")
    print(
        f"{result['requests']} requests x {result['texts_per_request']} texts at concurrency {result['concurrency']}"
        f"{f' + {adversarial} adversarial clients' if adversarial else ''}: {result['errors']} errors"
    )
    for problem in result["first_errors"]:
        print(f"  error: {problem}")
    print(
        f"latency p50 {result['p50_ms']:.1f} ms  p90 {result['p90_ms']:.1f} ms  p99 {result['p99_ms']:.1f} ms  "
        f"max {result['max_ms']:.1f} ms"
    )
    print(
        f"throughput {result['requests_per_s']:.1f} requests/s, {result['texts_per_s']:.1f} texts/s "
        f"(wall {result['wall_s']:.2f} s; 1-min load average at the end {result['load']:.2f})"
    )
    if adversarial:
        print(f"adversarial replies: {result['adversary_replies']}")
        print(f"adversarial replies other than expected: {result['adversary_unexpected']}")
        for problem in result["first_unexpected"]:
            print(f"  unexpected: {problem}")
        if result["oversized_p50_ms"] is not None:
            print(
                f"3.9 MB text: p50 {result['oversized_p50_ms']:.0f} ms, max {result['oversized_max_ms']:.0f} ms "
                "per request"
            )
    if rss:
        print(
            f"server RSS: {rss['rss_before_mb']:.0f} MB after warm-up, peak {rss['rss_peak_mb']:.0f} MB, "
            f"{rss['rss_after_mb']:.0f} MB after the run (growth {rss['rss_after_mb'] - rss['rss_before_mb']:+.0f} MB)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
