"""``recovery-fsm serve``: a Hugging Face checkpoint served over OpenAI's HTTP API by
rollout groups that recover.

Without a trainer the weights never change. The groups boot with the directory's weights
and take them again as version 1, whose export is the recovery checkpoint: a group that
dies or hangs boots from it (or a standby takes over) while the front issues its requests
again, and every answer says version 1. A trainer that owns a runtime starts
the same front on it with ``OpenAIFront(runtime).start()``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from . import USAGE, Failed


def _load(model_dir: Path) -> tuple[Any, Any]:
    """The model on the CPU (its weights are exported for the engines) and its tokenizer,
    if the directory holds one (without it: prompts as token ids only)."""
    if not (model_dir / "config.json").is_file():
        raise Failed(f"{model_dir} holds no config.json; give a Hugging Face model directory",
                     USAGE)  # fmt: skip
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = None
    if any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return model, tokenizer


def _engine(name: str, max_model_len: int | None, dtype: str) -> type:
    if name == "reference":
        from ..ray import ReferenceEngine

        return ReferenceEngine
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise Failed(f"--engine vllm needs the extra [vllm] ({err}); pip install -e '.[vllm]'"
                     ) from err  # fmt: skip
    from ..ray.vllm_engine import VLLMEngine

    # The checkpoint's dtype: vLLM's "auto" serves float32 as bfloat16, which this CPU may
    # lack (a crash, not an error), and the canary's tolerance is the checkpoint's.
    options: dict[str, Any] = {"dtype": dtype}
    if max_model_len is not None:
        options.update(max_model_len=max_model_len,
                       max_num_batched_tokens=max(max_model_len, 256))  # fmt: skip
    return VLLMEngine.with_options(**options)


def serve(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Boot the fleet, serve until SIGINT or SIGTERM (or ``stop``), then close in order:
    the front, the runtime (its engines), Ray if it started it, its temporary root. A
    second Ctrl-C interrupts a close that hangs."""
    import ray

    from ..ray import start_local_cluster

    model_dir = Path(args.model)
    model, tokenizer = _load(model_dir)
    engine = _engine(args.engine, args.max_model_len, str(model.dtype).removeprefix("torch."))
    stop = stop or threading.Event()
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="recovery-fsm-serve-"))
    started_ray = False
    handlers: dict[int, Any] = {}
    try:
        if not ray.is_initialized():
            if args.ray_address:
                ray.init(address=args.ray_address, log_to_driver=False)
            else:  # a private cluster on this machine, never one another process recorded
                start_local_cluster(num_cpus=args.num_cpus)
            started_ray = True
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets its own
                handlers[sig] = signal.signal(sig, lambda *_: _stop_once(stop, handlers))
        return _run(args, model, tokenizer, engine, root, stop)
    finally:
        try:
            if started_ray:
                ray.shutdown()
        finally:
            for number, old in handlers.items():
                signal.signal(number, old)
            if not args.root:
                shutil.rmtree(root, ignore_errors=True)


def _stop_once(stop: threading.Event, handlers: dict[int, Any]) -> None:
    """The first signal stops serving; the next one interrupts the close (the old
    handlers are back)."""
    stop.set()
    for sig, old in handlers.items():
        signal.signal(sig, old)


def _run(args: argparse.Namespace, model: Any, tokenizer: Any, engine: type, root: Path,
         stop: threading.Event) -> int:  # fmt: skip
    import ray

    from ..ray import RecoveryRuntime
    from ..serve import FrontLimits, OpenAIFront

    with RecoveryRuntime(
        root, groups=[f"g{i}" for i in range(args.groups)], model_config=model.config,
        engine=engine, standby=args.standby, tokenizer=tokenizer,
    ) as rt:  # fmt: skip
        rt.start(model)
        # Version 1 is the directory's weights again, synced so that it is exported: the
        # recovery checkpoint a group that dies boots from (start() exports nothing).
        rt.sync(model, 1)
        # start() returns once the groups are booted; their routes follow on the link's
        # thread. A front opened before them would answer its first requests with 503.
        deadline = time.monotonic() + 60.0
        while rt.rollouts.groups_serving() < args.groups and time.monotonic() < deadline:
            if stop.wait(0.05):
                return 0
        up = rt.rollouts.groups_serving()
        if up < args.groups:
            print(f"note: {up} of {args.groups} groups serve after 60 s; the others recover "
                  "meanwhile", file=sys.stderr, flush=True)  # fmt: skip
        name = args.served_model_name or Path(args.model).name
        limits = FrontLimits(in_flight_per_client=args.max_in_flight)
        with OpenAIFront(rt, model=name, host=args.host, port=args.port, api_key=args.api_key,
                         limits=limits) as front:  # fmt: skip
            where = ray.get_runtime_context().gcs_address
            print(f"serving {front.url}/v1 (model {name!r}, {args.groups} group(s) of "
                  f"{args.engine}, {up} up, Ray at {where}); Ctrl-C stops",
                  flush=True)  # fmt: skip
            stop.wait()
        print("stopping", flush=True)
    return 0


def add_parser(sub: Any, positive: Any, at_least_0: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a Hugging Face model over OpenAI's HTTP API with groups that recover",
    )
    p.add_argument("model", help="a Hugging Face model directory (config.json, weights, "
                                 "tokenizer files if prompts come as text)")  # fmt: skip
    p.add_argument("--groups", type=positive(int), default=1, help="rollout groups (default 1)")
    p.add_argument("--standby", type=at_least_0, default=0, help="warm standbys (default 0)")
    p.add_argument("--engine", choices=["reference", "vllm"], default="vllm",
                   help="vLLM (default; extra [vllm]) or the transformers reference")  # fmt: skip
    p.add_argument("--max-model-len", type=positive(int), default=None,
                   help="vLLM's longest prompt plus completion (default 256)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=at_least_0, default=8000, help="0: any free port")
    p.add_argument("--api-key", default=os.environ.get("RECOVERY_FSM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $RECOVERY_FSM_API_KEY, "
                        "which keeps the key out of the process list)")  # fmt: skip
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the directory's name)")  # fmt: skip
    p.add_argument("--max-in-flight", type=positive(int), default=32,
                   help="requests in flight per client; past it, 429 (default 32)")  # fmt: skip
    p.add_argument("--root", default=None,
                   help="where recovery checkpoints go (default: a temporary directory, "
                        "removed at exit)")  # fmt: skip
    p.add_argument("--num-cpus", type=positive(int), default=None,
                   help="CPUs of the private Ray cluster (default: all)")  # fmt: skip
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster instead of starting a private one")  # fmt: skip
    p.set_defaults(func=serve)
