"""An OpenAI-compatible HTTP front over the runtime's rollout path.

Agent frameworks and environment libraries speak OpenAI's HTTP API to their rollout
engines, through routers that know nothing of weight versions or recovery. This front
answers ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and ``/health`` by
calling ``RecoveryRuntime.arollout``, so a request inherits what that path guarantees: it
goes only to a process the controller routes, a call whose engine dies or hangs is issued
again, a sync's pause mode holds it like any rollout, and every choice carries the
certificate of the process and weight version that produced it (in the body, and the
version in the ``X-Recovery-Version`` header). A response is one version: the front asks
``Policy(version="same")``. Concurrent requests of the same sampling are merged into one
rollout call (``batching.py``), as an engine's own server steps them together.

Why FastAPI and uvicorn, not Ray Serve: the front lives in the process that owns the
runtime (the trainer's, or ``recovery-fsm serve``'s) and reads its routes directly; Ray
Serve would add a controller, proxies and a deployment between the client and the routes
it needs to read, for scaling this process does not need (the engines are the work).

What it does not do (see the README): token-by-token streaming (a stream carries each
choice whole, once it is certified, so a death can never cut a stream: the request is
issued again before anything was sent), ``echo``, ``best_of``, penalties, ``logit_bias``,
tools and multimodal content.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import attrs
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .. import RecoveryError
from ..ray import BadSampling, Policy, PromptSamples, RolloutFailed, Sampling
from .batching import Batcher

VERSION_HEADER = "X-Recovery-Version"
CERTIFICATES_HEADER = "X-Recovery-Certificates"


@attrs.frozen
class FrontLimits:
    """What one request may ask for, and how many a client may have in flight (past that:
    429). ``deadline_s`` bounds a request's whole rollout (then 503); ``request_timeout_s``
    one engine call (a hang: the call is issued again elsewhere)."""

    max_prompt_tokens: int = 4096
    max_tokens: int = 1024
    max_n: int = 16
    max_prompts: int = 64
    in_flight_per_client: int = 32
    deadline_s: float = 60.0
    request_timeout_s: float = 30.0
    retry_after_s: int = 1
    batch_prompts: int = 64  # prompts of concurrent requests merged into one call, at most
    batch_gather_s: float = 0.002  # how long a call waits for company before it is sent


# -- requests: unknown fields are refused, as everything else that is not what we take ----


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CompletionRequest(_Strict):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None
    stream: bool = False
    user: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(_Strict):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False
    user: str | None = None


class _Refused(Exception):
    """An answer other than 200, as OpenAI's clients read errors."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status,
            message,
            kind,
            param,
            code,
        )


def _error(
    status: int,
    message: str,
    kind: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class _Clients:
    """Requests in flight per client (its API key, else its address)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}

    def enter(self, client: str) -> bool:
        with self._lock:
            if self._in_flight.get(client, 0) >= self._limit:
                return False
            self._in_flight[client] = self._in_flight.get(client, 0) + 1
            return True

    def total(self) -> int:
        with self._lock:
            return sum(self._in_flight.values())

    def leave(self, client: str) -> None:
        with self._lock:
            left = self._in_flight[client] - 1
            if left:
                self._in_flight[client] = left
            else:
                del self._in_flight[client]


@attrs.frozen
class _Choice:
    index: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[dict[int, float], ...] | None
    text: str | None
    finish_reason: str
    certificate: dict[str, Any]


class _Front:
    """The app's state: the runtime, the tokenizer (None: token ids only), the limits."""

    def __init__(
        self, runtime: Any, model: str, tokenizer: Any, api_key: str | None, limits: FrontLimits
    ) -> None:
        self.rt = runtime
        self.model = model
        self.tok = tokenizer
        self.api_key = api_key
        self.limits = limits
        self.clients = _Clients(limits.in_flight_per_client)
        self.created = int(time.time())
        policy = Policy(
            version="same",
            deadline_s=limits.deadline_s,
            request_timeout_s=limits.request_timeout_s,
        )
        self.batcher = Batcher(
            runtime.arollout, policy, max_prompts=limits.batch_prompts,
            calls_per_lane=runtime.rollouts.groups_serving, gather_s=limits.batch_gather_s,
        )  # fmt: skip

    # -- from a request to prompts and sampling ---------------------------------------------

    def encode(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tok is None:
                raise _Refused(
                    400,
                    "this front has no tokenizer: send prompts as token ids (a list of ints)",
                    param=param,
                )
            ids = list(self.tok.encode(prompt, add_special_tokens=True))
        else:
            ids = list(prompt)
        if not ids:
            raise _Refused(400, "a prompt must hold at least one token", param=param)
        if len(ids) > self.limits.max_prompt_tokens:
            raise _Refused(
                400,
                f"a prompt may hold at most {self.limits.max_prompt_tokens} tokens, got {len(ids)}",
                param=param,
            )
        return ids

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        if self.tok is None or getattr(self.tok, "chat_template", None) is None:
            raise _Refused(
                400,
                "this front has no tokenizer with a chat template: use "
                "/v1/completions with token ids",
                param="messages",
            )
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # a dict or BatchEncoding on some versions
            ids = ids["input_ids"]
        return self.encode(list(ids), "messages")

    def sampling(
        self,
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        n: int,
        seed: int | None,
        logprobs: int,
        prompts: int,
    ) -> Sampling:
        lim = self.limits
        if not 1 <= n <= lim.max_n:
            raise _Refused(400, f"n must be in [1, {lim.max_n}], got {n}", param="n")
        if not 1 <= max_tokens <= lim.max_tokens:
            raise _Refused(
                400,
                f"max_tokens must be in [1, {lim.max_tokens}], got {max_tokens}",
                param="max_tokens",
            )
        if not 1 <= prompts <= lim.max_prompts:
            raise _Refused(
                400,
                f"a request may hold 1 to {lim.max_prompts} prompts, got {prompts}",
                param="prompt",
            )
        eos = None if self.tok is None else self.tok.eos_token_id
        stops: tuple[int, ...] = () if eos is None else (int(eos),)
        try:
            return Sampling(
                max_new_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                n=n,
                seed=seed,
                logprobs=logprobs,
                stop_token_ids=stops,
            )
        except BadSampling as e:
            raise _Refused(400, str(e)) from None

    # -- the rollout ------------------------------------------------------------------------

    async def run(
        self, prompts: list[list[int]], sampling: Sampling, stop: Sequence[str]
    ) -> list[_Choice]:
        if self.rt.rollouts.fleet_version() is None:
            raise _Refused(503, "no group is serving now: retry", kind="service_unavailable")
        try:
            # deadline_s bounds the whole request: a wait for a merged call included.
            results: list[PromptSamples] = await asyncio.wait_for(
                self.batcher.submit(prompts, sampling), self.limits.deadline_s
            )
        except asyncio.TimeoutError:
            raise _Refused(503, f"not answered within deadline_s={self.limits.deadline_s}",
                           "service_unavailable") from None  # fmt: skip
        except BadSampling as e:
            raise _Refused(400, str(e), param="prompt") from None
        except RolloutFailed as e:
            if e.refused:  # the engine refuses the request itself: no retry would do
                raise _Refused(400, f"the engine refused the request: {e}", param="prompt") from e
            raise _Refused(503, f"the fleet did not answer: {e}", "service_unavailable") from e
        except RecoveryError as e:  # the runtime stopped (fail-stop) or is closing
            raise _Refused(503, f"the runtime is not serving: {e}", "service_unavailable") from e
        out: list[_Choice] = []
        for r in results:
            for s in r.samples:
                tokens, lps, tops, reason = s.tokens, s.logprobs, s.top_logprobs, s.finish_reason
                text = None
                if self.tok is not None:
                    tokens, text, cut = self._stop_at(tokens, stop)
                    if cut:
                        lps = lps[: len(tokens)]
                        tops = None if tops is None else tops[: len(tokens)]
                        reason = "stop"
                cert = attrs.asdict(s.certificate)
                out.append(_Choice(len(out), tokens, lps, tops, text, reason, cert))
        return out

    def _stop_at(
        self, tokens: tuple[int, ...], stop: Sequence[str]
    ) -> tuple[tuple[int, ...], str, bool]:
        """The tokens and text up to the first stop string (excluded), and whether one cut."""
        text = self.tok.decode(list(tokens), skip_special_tokens=True)
        if not stop or not any(s in text for s in stop):
            return tokens, text, False
        for k in range(1, len(tokens) + 1):
            prefix = self.tok.decode(list(tokens[:k]), skip_special_tokens=True)
            hits = [prefix.index(s) for s in stop if s in prefix]
            if hits:
                return tokens[:k], prefix[: min(hits)], True
        return tokens, text, False  # pragma: no cover - the full text held a stop string

    def token_name(self, token: int) -> str:
        name = None if self.tok is None else self.tok.convert_ids_to_tokens(int(token))
        return f"token_id:{token}" if name is None else str(name)

    # -- answers ----------------------------------------------------------------------------

    def headers(self, choices: Sequence[_Choice]) -> dict[str, str]:
        versions = sorted({c.certificate["version"] for c in choices})
        procs = sorted(
            {
                f"{c.certificate['group']}#{c.certificate['incarnation']}@{c.certificate['version']}"
                for c in choices
            }
        )
        return {VERSION_HEADER: ",".join(map(str, versions)), CERTIFICATES_HEADER: ",".join(procs)}

    def completion_logprobs(self, c: _Choice) -> dict[str, Any]:
        names = [self.token_name(t) for t in c.tokens]
        offsets, at = [], 0
        for name in names:
            offsets.append(at)
            at += len(name)
        tops = None
        if c.top_logprobs is not None:
            tops = [{self.token_name(t): lp for t, lp in d.items()} for d in c.top_logprobs]
        return {
            "tokens": names,
            "token_logprobs": list(c.logprobs),
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def chat_logprobs(self, c: _Choice) -> dict[str, Any]:
        content = []
        for k, (t, lp) in enumerate(zip(c.tokens, c.logprobs, strict=True)):
            name = self.token_name(t)
            tops = (
                []
                if c.top_logprobs is None
                else [
                    {
                        "token": self.token_name(a),
                        "logprob": alp,
                        "bytes": list(self.token_name(a).encode()),
                    }
                    for a, alp in c.top_logprobs[k].items()
                ]
            )
            content.append(
                {"token": name, "logprob": lp, "bytes": list(name.encode()), "top_logprobs": tops}
            )
        return {"content": content}


def _usage(prompts: list[list[int]], choices: Sequence[_Choice]) -> dict[str, int]:
    p, c = sum(len(x) for x in prompts), sum(len(x.tokens) for x in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise _Refused(400, "stop must be up to 4 non-empty strings", param="stop")
    return stops


def _sse(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return gen()


def build_app(
    runtime: Any,
    *,
    model: str = "policy",
    tokenizer: Any = None,
    api_key: str | None = None,
    limits: FrontLimits | None = None,
) -> FastAPI:
    """The ASGI app: serve it with any ASGI server, or let ``OpenAIFront`` run it.
    ``tokenizer``: the runtime's if not given; without one, prompts are token ids only."""
    tok = getattr(runtime, "tokenizer", None) if tokenizer is None else tokenizer
    front = _Front(runtime, model, tok, api_key, limits or FrontLimits())
    app = FastAPI(title="recovery-fsm", docs_url=None, redoc_url=None, openapi_url=None)
    retry = {"Retry-After": str(front.limits.retry_after_s)}

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            problems.append(f"{where or 'body'}: {err.get('msg')}")
        first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
        param = ".".join(str(x) for x in first if x != "body") or None
        return _error(400, "; ".join(problems), "invalid_request_error", param)

    @app.exception_handler(_Refused)
    async def refused(_: Request, exc: _Refused) -> JSONResponse:
        return _error(
            exc.status,
            exc.message,
            exc.kind,
            exc.param,
            exc.code,
            headers=retry if exc.status in (429, 503) else None,
        )

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Response:
        guarded = front.api_key is not None and request.url.path.startswith("/v1/")
        if guarded and request.headers.get("authorization") != f"Bearer {front.api_key}":
            return _error(
                401,
                "a valid API key is needed (Authorization: Bearer KEY)",
                "authentication_error",
                code="invalid_api_key",
            )
        response: Response = await call_next(request)
        return response

    def client_of(request: Request) -> str:
        auth = request.headers.get("authorization")
        if auth:
            return auth
        return request.client.host if request.client else "?"

    def check_model(name: str) -> None:
        if name != front.model:
            raise _Refused(
                404,
                f"model {name!r} is not served here; this front serves {front.model!r}",
                param="model",
                code="model_not_found",
            )

    @app.get("/health")
    async def health() -> JSONResponse:
        """Serving or not, at which version, and how many requests are in flight."""
        version = front.rt.rollouts.fleet_version()
        status, code = ("ok", 200) if version is not None else ("unavailable", 503)
        body = {"status": status, "version": version, "in_flight": front.clients.total()}
        return JSONResponse(body, status_code=code, headers=None if version is not None else retry)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        entry = {
            "id": front.model,
            "object": "model",
            "created": front.created,
            "owned_by": "recovery-fsm",
            "weight_version": front.rt.rollouts.fleet_version(),
        }
        return JSONResponse({"object": "list", "data": [entry]})

    async def answer(
        request: Request, prompts: list[list[int]], sampling: Sampling, stop: list[str]
    ) -> list[_Choice]:
        client = client_of(request)
        if not front.clients.enter(client):
            raise _Refused(
                429,
                f"at most {front.limits.in_flight_per_client} requests in flight per client",
                kind="rate_limit_error",
            )
        try:
            return await front.run(prompts, sampling, stop)
        finally:
            front.clients.leave(client)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        check_model(req.model)
        raw = req.prompt
        one = isinstance(raw, str) or (bool(raw) and isinstance(raw[0], int))
        batch: list[Any] = [raw] if one else list(raw)
        prompts = [front.encode(p, "prompt") for p in batch]
        top = req.logprobs or 0
        sampling = front.sampling(
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            n=req.n,
            seed=req.seed,
            logprobs=top,
            prompts=len(prompts),
        )
        choices = await answer(request, prompts, sampling, _stops(req.stop))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def choice(c: _Choice) -> dict[str, Any]:
            return {
                "index": c.index,
                "text": c.text if c.text is not None else "",
                "logprobs": front.completion_logprobs(c) if req.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "token_ids": list(c.tokens),
                "certificate": c.certificate,
            }

        base = {"id": rid, "object": "text_completion", "created": created, "model": front.model}
        version = choices[0].certificate["version"]
        headers = front.headers(choices)
        if req.stream:
            chunks = [{**base, "choices": [choice(c)], "weight_version": version} for c in choices]
            return StreamingResponse(_sse(chunks), media_type="text/event-stream", headers=headers)
        body = {
            **base,
            "choices": [choice(c) for c in choices],
            "usage": _usage(prompts, choices),
            "weight_version": version,
        }
        return JSONResponse(body, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Response:
        check_model(req.model)
        prompt = front.chat_prompt(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise _Refused(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens = req.max_completion_tokens or req.max_tokens or 16
        sampling = front.sampling(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            n=req.n,
            seed=req.seed,
            logprobs=req.top_logprobs or 0,
            prompts=1,
        )
        choices = await answer(request, [prompt], sampling, _stops(req.stop))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "created": created, "model": front.model}
        version = choices[0].certificate["version"]
        headers = front.headers(choices)

        def logprobs(c: _Choice) -> dict[str, Any] | None:
            return front.chat_logprobs(c) if req.logprobs else None

        if req.stream:
            chunks = []
            for c in choices:
                delta = {"role": "assistant", "content": c.text or ""}
                chunks.append(
                    {
                        **base,
                        "object": "chat.completion.chunk",
                        "choices": [
                            {
                                "index": c.index,
                                "delta": delta,
                                "logprobs": logprobs(c),
                                "finish_reason": c.finish_reason,
                                "certificate": c.certificate,
                            }
                        ],
                        "weight_version": version,
                    }
                )
            return StreamingResponse(_sse(chunks), media_type="text/event-stream", headers=headers)
        body = {
            **base,
            "object": "chat.completion",
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text or ""},
                    "logprobs": logprobs(c),
                    "finish_reason": c.finish_reason,
                    "token_ids": list(c.tokens),
                    "certificate": c.certificate,
                }
                for c in choices
            ],
            "usage": _usage([prompt], choices),
            "weight_version": version,
        }
        return JSONResponse(body, headers=headers)

    return app


class OpenAIFront:
    """``build_app`` served by uvicorn on a thread of this process, bound to 127.0.0.1 by
    default (``port=0``: any free port; ``url`` says which)."""

    def __init__(
        self,
        runtime: Any,
        *,
        model: str = "policy",
        tokenizer: Any = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        limits: FrontLimits | None = None,
    ) -> None:
        import uvicorn

        self.app = build_app(
            runtime, model=model, tokenizer=tokenizer, api_key=api_key, limits=limits
        )
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._host = host

    def start(self, timeout_s: float = 30.0) -> OpenAIFront:
        self._thread = threading.Thread(target=self._server.run, name="openai-front", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP front did not start on {self._host}")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        sockets = self._server.servers[0].sockets
        return int(sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> OpenAIFront:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
