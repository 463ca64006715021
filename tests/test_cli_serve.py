"""``recovery-fsm serve`` as a user runs it: a process of its own, on a model directory
saved here (a tiny Llama and a tokenizer trained here), answering the ``openai`` client,
stopped by SIGTERM. A Ray head runs on the machine throughout (``ray start --head``, as on
a developer's box): the tests' own cluster and serve's start private ones beside it, and
serve joins it when told to."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_LLAMA, same_port

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from test_openai_front import small_tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

ray = pytest.importorskip("ray")
# The head first: the module's own cluster then starts while it runs.
pytestmark = pytest.mark.usefixtures("ray_head", "ray_cluster")


def _cli(*args: str, log: Path | None = None) -> subprocess.Popen[str]:
    """serve as a process of its own; its stderr goes to ``log`` (a pipe nobody reads
    until the end could fill and stall it)."""
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    err = subprocess.PIPE if log is None else log.open("w")
    return subprocess.Popen([sys.executable, "-m", "recovery_fsm.cli", *args], text=True,
                            stdout=subprocess.PIPE, stderr=err, env=env)  # fmt: skip


def _url(proc: subprocess.Popen[str], log: Path, timeout_s: float = 240.0) -> tuple[str, str]:
    """The base URL serve prints, and the Ray cluster it runs on."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or ()],
                     daemon=True).start()  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            if proc.poll() is not None:
                pytest.fail(f"serve exited {proc.returncode}: {log.read_text()[-3000:]}")
            continue
        if m := re.match(r"serving (http://\S+/v1) .* Ray at (\S+)\)", line):
            return m.group(1), m.group(2)
    pytest.fail(f"serve printed no URL within {timeout_s} s: {log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[str], log: Path) -> str:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    assert proc.returncode == 0, log.read_text()[-3000:]
    return log.read_text()


def _model_dir(tmp_path: Path) -> Any:
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).eval()
    model.save_pretrained(tmp_path / "tiny")
    small_tokenizer().save_pretrained(tmp_path / "tiny")
    return model


def test_the_tests_cluster_is_a_private_one_beside_a_ray_head_already_running(
    ray_head: str,
) -> None:
    # Plain ray.init(num_cpus=2) would have joined the head, and refused num_cpus.
    assert ray.is_initialized()
    assert not same_port(ray.get_runtime_context().gcs_address, ray_head)
    assert ray.cluster_resources().get("CPU") == 2  # the head has 1


def test_serve_answers_a_model_directory_with_certified_samples_and_stops_on_sigterm(
    tmp_path: Path, ray_head: str
) -> None:
    model = _model_dir(tmp_path)
    root, log = tmp_path / "root", tmp_path / "serve.log"
    proc = _cli("serve", str(tmp_path / "tiny"), "--engine", "reference", "--groups", "2",
                "--port", "0", "--num-cpus", "2", "--root", str(root), log=log)  # fmt: skip
    try:
        url, cluster = _url(proc, log)
        assert not same_port(cluster, ray_head)  # a private cluster, though a head runs
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        prompt = "the trainer syncs the weights"
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, n=2,
                                           logprobs=0, temperature=1.0, seed=1)  # fmt: skip
        assert answer.model_extra["weight_version"] == 1  # the directory's weights, exported
        ids = small_tokenizer()(prompt)["input_ids"]
        for choice in answer.choices:
            tokens = choice.model_extra["token_ids"]
            assert choice.model_extra["certificate"]["version"] == 1
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([[*ids, *tokens]])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            want = [float(lp[len(ids) - 1 + k, t]) for k, t in enumerate(tokens)]
            assert choice.logprobs.token_logprobs == pytest.approx(want, abs=2e-3)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        saved = [p.parent.name for p in root.rglob("config.json")]
        assert saved, f"no recovery checkpoint under --root: {list(root.rglob('*'))}"
    finally:
        _stop(proc, log)
    assert not list(root.rglob("config.json"))  # close() deleted the recovery checkpoints


def test_serve_joins_a_running_cluster_when_given_its_address(
    tmp_path: Path, ray_head: str
) -> None:
    _model_dir(tmp_path)
    log = tmp_path / "serve.log"
    proc = _cli("serve", str(tmp_path / "tiny"), "--engine", "reference", "--port", "0",
                "--ray-address", ray_head, log=log)  # fmt: skip
    try:
        url, cluster = _url(proc, log)
        assert same_port(cluster, ray_head)
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        answer = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3)
        assert answer.model_extra["weight_version"] == 1
    finally:
        _stop(proc, log)


def test_serve_refuses_a_directory_without_a_model_in_one_line(tmp_path: Path) -> None:
    proc = _cli("serve", str(tmp_path), "--engine", "reference")
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().count("\n") == 0 and "holds no config.json" in err, err
