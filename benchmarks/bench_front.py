"""The HTTP front against vLLM's own OpenAI server, on one vLLM engine, side by side:

- ``vllm``: ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs) on
  a model directory;
- ``front``: ``recovery-fsm serve`` on the same directory, one group of ``VLLMEngine``
  (the same ``vllm.LLM`` options), behind the recovery runtime and its OpenAI front.

Each server runs alone (two cores: never both at once), arms alternating per repeat. At
each concurrency C, C clients send completions back to back for ``--seconds`` (after a
warm-up): requests per second, latency percentiles, and the cores the server's processes
used (CPU seconds per second, all its processes; the clients run in this one). Same
prompts (8 token ids), same sampling (temperature 1, 16 tokens, logprobs 1) for both.

Then kills, on the front only (vLLM's server has no recovery to measure): 4 clients
running, one engine process SIGKILLed, the times from the kill to the first and the last
answer of the requests in flight at the kill, and every request's outcome. With one group
every such request was on the killed engine, and a reboot from the recovery checkpoint
answers it (the first answer is the first retried one); with two, the other group answers
those of the killed one (the last answer is a retried one, the first may not be).

    .venv/bin/python benchmarks/bench_front.py [--concurrency 1 4 8] [--seconds 20]
        [--repeats 2] [--kills 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from recovery_fsm.ray.vllm_engine import DEFAULT_OPTIONS, ENGINE_ENV

# Head size 64: what vLLM's CPU attention takes.
CONFIG = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
    architectures=["LlamaForCausalLM"],
)  # fmt: skip
BODY = {"max_tokens": 16, "temperature": 1.0, "logprobs": 1}


def model_dir(work: Path) -> Path:
    out = work / "tiny"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).save_pretrained(out)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    size = CONFIG["vocab_size"]
    trainer = trainers.WordLevelTrainer(vocab_size=size, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([f"w{i}" for i in range(size)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)  # fmt: skip
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(arm: str, path: Path, port: int, groups: int = 1) -> subprocess.Popen[bytes]:
    env = {**os.environ, **ENGINE_ENV}
    o = DEFAULT_OPTIONS
    if arm == "vllm":
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # its server as users run it
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
               "--served-model-name", "tiny", "--port", str(port), "--enforce-eager",
               "--dtype", "float32",
               "--max-model-len", str(o["max_model_len"]),
               "--max-num-seqs", str(o["max_num_seqs"]),
               "--max-num-batched-tokens", str(o["max_num_batched_tokens"]),
               "--kv-cache-memory-bytes", str(o["kv_cache_memory_bytes"]),
               "--no-enable-prefix-caching", "--disable-log-stats", "--seed", "0",
               "--uvicorn-log-level", "warning"]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "recovery_fsm.cli", "serve", str(path), "--engine", "vllm",
               "--groups", str(groups), "--port", str(port), "--served-model-name", "tiny",
               "--num-cpus", "2", "--max-in-flight", "64"]  # fmt: skip
    log = path.parent / f"{arm}-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{arm} exited {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{arm} did not serve within 300 s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
        proc.wait()


def prompt(i: int) -> list[int]:
    return [(7 * i + j) % 250 + 3 for j in range(8)]


async def load(port: int, clients: int, seconds: float,
               events: list[tuple[float, float, int]] | None = None) -> list[float]:  # fmt: skip
    """Latencies of the requests answered within ``seconds``; ``events`` gets every
    request's (sent, done, status)."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    lat: list[float] = []
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:

        async def client(c: int) -> None:
            i = c
            while time.monotonic() < end:
                sent = time.monotonic()
                r = await http.post(url, json={"model": "tiny", "prompt": prompt(i), **BODY})
                done = time.monotonic()
                if events is not None:
                    events.append((sent, done, r.status_code))
                if r.status_code == 200:
                    lat.append(done - sent)
                i += clients

        await asyncio.gather(*(client(c) for c in range(clients)))
    return lat


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def cpu_s(proc: subprocess.Popen[bytes]) -> float:
    """CPU seconds used so far by the server and every process it started."""
    total = 0.0
    root = psutil.Process(proc.pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def throughput(path: Path, args: argparse.Namespace) -> None:
    rows: dict[tuple[str, int], list[tuple[float, list[float], float]]] = {}
    for r in range(args.repeats):
        for arm in ("vllm", "front") if r % 2 == 0 else ("front", "vllm"):
            port = free_port()
            proc = start(arm, path, port)
            try:
                asyncio.run(load(port, max(args.concurrency), 3.0))  # warm-up
                for c in args.concurrency:
                    used = cpu_s(proc)
                    lat = asyncio.run(load(port, c, args.seconds))
                    cores = (cpu_s(proc) - used) / args.seconds
                    rows.setdefault((arm, c), []).append((len(lat) / args.seconds, lat, cores))
            finally:
                stop(proc)
    print(f"\n{'C':>3} {'arm':>6} {'req/s':>7} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}"
          f" {'p50 ratio':>10} {'server cores':>13}")  # fmt: skip
    for c in args.concurrency:
        p50: dict[str, float] = {}
        for arm in ("vllm", "front"):
            runs = rows[(arm, c)]
            lat = [x for _, xs, _ in runs for x in xs]
            rps = statistics.median(r for r, _, _ in runs)
            cores = statistics.median(k for _, _, k in runs)
            p50[arm] = pct(lat, 0.5)
            ratio = f"{p50[arm] / p50['vllm']:.2f}x" if arm == "front" else ""
            tail = f"{pct(lat, 0.9) * 1e3:>8.0f} {pct(lat, 0.99) * 1e3:>8.0f}"
            print(f"{c:>3} {arm:>6} {rps:>7.1f} {p50[arm] * 1e3:>8.0f} {tail} {ratio:>10} "
                  f"{cores:>13.2f}")  # fmt: skip


def engines(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The engine actors' processes, all descendants of the serve process (its private
    Ray cluster): only processes this benchmark made are killed."""
    out = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "VLLMEngine" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def kills(path: Path, groups: int, args: argparse.Namespace, clients: int = 4) -> None:
    port = free_port()
    proc = start("front", path, port, groups=groups)
    found = []
    try:
        asyncio.run(load(port, clients, 3.0))
        for _ in range(args.kills):
            events: list[tuple[float, float, int]] = []

            async def run(events: list[tuple[float, float, int]]) -> float:
                task = asyncio.ensure_future(load(port, clients, 8.0 + 30.0 * (groups == 1),
                                                  events))  # fmt: skip
                await asyncio.sleep(2.0)
                victim = engines(proc)[0]
                t0 = time.monotonic()
                victim.send_signal(signal.SIGKILL)
                await task
                return t0

            t0 = asyncio.run(run(events))
            spanning = [e for e in events if e[0] < t0 < e[1]]
            answered = [d - t0 for _, d, st in spanning if st == 200]
            bad = sum(st != 200 for _, _, st in events)
            found.append((min(answered, default=float("nan")),
                          max(answered, default=float("nan")), len(spanning), bad,
                          len(events)))  # fmt: skip
            time.sleep(30.0)  # the killed group's reboot, before the next kill
    finally:
        stop(proc)
    for first, last, spanning, bad, total in found:
        print(f"{groups} group(s): kill -> answers of the {spanning} requests in flight: "
              f"first {first * 1e3:.0f} ms, last {last * 1e3:.0f} ms; {bad} of {total} "
              "requests not 200")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kills", type=int, default=2)
    args = parser.parse_args()
    print(f"cpus {os.cpu_count()}, load {os.getloadavg()[0]:.2f}; sampling {BODY}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        path = model_dir(work)
        throughput(path, args)
        if args.kills:
            kills(path, 2, args)
            kills(path, 1, args)
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
