"""Methods mixed into vLLM's worker (``worker_extension_cls``), called through
``collective_rpc``: they run where the model lives.

Every load goes through ``model_runner.reload_weights``, vLLM's own in-place path, which
fuses the hub tensors into its packed parameters (q/k/v, gate/up) and re-packs the CPU
kernels' copies; writing a parameter directly would not reach those copies. The runner's
``reload_weights(weights_path=...)`` refuses an engine booted with dummy weights, so the
files are read here and handed over as an iterator, which works after either boot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class WeightLoader:
    model_runner: Any  # vLLM's, on the worker this class is mixed into

    def recovery_load_files(self, files: list[str]) -> int:
        """Load the named safetensors files (a checkpoint's shards) in place."""
        from safetensors.torch import load_file

        tensors: list[tuple[str, torch.Tensor]] = []
        for f in files:
            tensors.extend(load_file(f).items())
        self.model_runner.reload_weights(weights_iterator=iter(tensors))
        return len(tensors)

    def recovery_load_tensors(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load pushed tensors (hub names) in place. In-process engines only: vLLM's RPC
        between processes does not carry tensors."""
        self.model_runner.reload_weights(weights_iterator=iter(named))
        return len(named)


def shard_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory, in name order."""
    return [str(p) for p in sorted(Path(path).glob("*.safetensors"))]
