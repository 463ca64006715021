"""Every Python block of the README (and of docs/export.md, whose example moved there) runs
as written, so they cannot drift."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "export.md"]
BLOCKS = [
    block
    for page in PAGES
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
]


def test_the_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # examples write their journals and checkpoints here
    code = compile(BLOCKS[index], f"README.md python block {index}", "exec")
    try:
        exec(code, {"__name__": f"readme_{index}"})
    finally:
        # An example that raises before its own ray.shutdown() must not leave Ray up for
        # the modules after it (their ray.init would refuse).
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
