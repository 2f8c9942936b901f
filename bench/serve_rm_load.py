"""Load test of the reward-model server: many concurrent `POST /get_reward` requests against a local server.

    python bench/serve_rm_load.py                                  # 1000 requests, 32 at a time, tiny kit RM
    python bench/serve_rm_load.py --requests 2000 --concurrency 64 --texts-per-request 8
    python bench/serve_rm_load.py --url http://127.0.0.1:5000/get_reward   # an already running server

Without ``--url`` the script saves the offline kit's tiny reward model (a random 2-layer GPT-NeoX classifier) to a
temporary folder, starts ``recipes/serve_rm.py`` on a free loopback port in a subprocess (so the server and the
client threads do not share a GIL), waits for ``/health`` and then sends ``--requests`` requests from
``--concurrency`` client threads sharing one ``httpx.Client``. Each request carries ``--texts-per-request`` prompt +
response texts from the kit's prompts (5–40 tokens). Every reply is checked: HTTP 200 and one finite reward per
text; anything else counts as an error.

Printed: the number of errors, latency percentiles (p50, p90, p99, max) from request start to reply parsed, and the
throughput (requests/s and texts/s over the wall time of the whole run). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
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

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(folder: str, port: int, batch_size: int, threads: int) -> subprocess.Popen:
    """Save the tiny reward model into ``folder`` and serve it on ``port`` (a subprocess of the recipe)."""
    sys.path.insert(0, str(REPO))
    from trl_ext import testing as kit

    tokenizer = kit.build_tokenizer()
    kit.save_tiny_model(kit.build_sequence_classifier("gpt_neox", tokenizer=tokenizer), tokenizer, folder)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable, str(REPO / "recipes" / "serve_rm.py"), "--reward_model_path", folder, "--port", str(port),
        "--batch_size", str(batch_size), "--log_level", "warning",
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_health(client, base: str, server: subprocess.Popen | None, timeout: float = 180.0) -> dict:
    deadline = time.time() + timeout
    while True:
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"The server exited with {server.returncode}:\n{server.stderr.read()[-3000:]}")
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


def run_load(url: str, requests: int, concurrency: int, texts_per_request: int, seed: int, client) -> dict:
    """Send the requests and return the measurements."""
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--texts-per-request", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16, help="server --batch_size (own server only)")
    parser.add_argument("--server-threads", type=int, default=1, help="OMP threads of the server (own server only)")
    parser.add_argument("--url", default=None, help="an already running /get_reward endpoint (else start one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)

    import httpx

    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    server = None
    with tempfile.TemporaryDirectory() as folder, httpx.Client(limits=limits) as client:
        if args.url is None:
            port = _free_port()
            server = _start_server(os.path.join(folder, "reward"), port, args.batch_size, args.server_threads)
            url = f"http://127.0.0.1:{port}/get_reward"
        else:
            url = args.url
        try:
            health = _wait_for_health(client, url.rsplit("/", 1)[0], server)
            client.post(url, json={"query": ["warm-up text"]}, timeout=60.0)  # first forward pass: lazy init
            result = run_load(url, args.requests, args.concurrency, args.texts_per_request, args.seed, client)
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=30)
    result.update(model=health.get("model"), server_batch_size=health.get("batch_size"), load=os.getloadavg()[0])
    print(f"server: {health.get('model')} at {url} (batch_size {health.get('batch_size')})")
    print(
        f"{result['requests']} requests x {result['texts_per_request']} texts at concurrency {result['concurrency']}: "
        f"{result['errors']} errors"
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
