"""``recovery-fsm serve`` as a user runs it: a process of its own, on a model directory
saved here (a tiny Llama and a tokenizer trained here), answering the ``openai`` client,
stopped by SIGTERM. It starts a private Ray cluster beside the tests' own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_LLAMA

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from test_openai_front import small_tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402


def _cli(*args: str, **kw: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    return subprocess.Popen([sys.executable, "-m", "recovery_fsm.cli", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            **kw)  # fmt: skip


def _url(proc: subprocess.Popen[str], timeout_s: float = 240.0) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            pytest.fail(f"serve exited {proc.returncode}: {proc.stderr and proc.stderr.read()}")
        if m := re.match(r"serving (http://\S+/v1) ", line):
            return m.group(1)
    pytest.fail("serve printed no URL")


def test_serve_answers_a_model_directory_with_certified_samples_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).eval()
    model.save_pretrained(tmp_path / "tiny")
    small_tokenizer().save_pretrained(tmp_path / "tiny")
    root = tmp_path / "root"
    proc = _cli("serve", str(tmp_path / "tiny"), "--engine", "reference", "--groups", "2",
                "--port", "0", "--num-cpus", "2", "--root", str(root))  # fmt: skip
    try:
        url = _url(proc)
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
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "stopping" in out


def test_serve_refuses_a_directory_without_a_model_in_one_line(tmp_path: Path) -> None:
    proc = _cli("serve", str(tmp_path), "--engine", "reference")
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().count("\n") == 0 and "holds no config.json" in err, err
