"""Whether a process that booted, loaded or took a push holds the weights it was given.

Two gates, each where it can work: the **digest gate** (every actor reports the digest of
the tensors it holds; only engines that keep the hub layout can compute it, so an engine
class says whether it does with ``COMPUTES_DIGEST``) and the **canary** (every actor answers
the canary prompt and must agree with the trainer's answer, ``export.canary``; any engine
can). A start with neither gate available is refused: nothing would vouch for it.

The verdict is the start's outcome, not a decision: a refusal is reported as a failed load
(``RestartLoadFailed``, which cools immediate recovery) with the reason in the journal.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from ..export.canary import Canary, CanaryError, check
from .actors import Booted, BootFailed, Launcher


class RefusalKind(str, enum.Enum):
    """Why a process that started was not let serve: the gate that refused it, or what kept
    any gate from vouching for it. A start that failed outright (its engine raised, its
    process died) is no refusal: its reason is the engine's own cause."""

    DIGEST = "digest"  # an actor holds other weights than the record's digest
    CANARY = "canary"  # an actor's canary answer differs from the trainer's (or none came)
    NO_EVIDENCE = "no_evidence"  # neither gate is available for these weights
    NO_RECORD = "no_record"  # no push or checkpoint records what that version holds
    WRONG_VERSION = "wrong_version"  # it holds another version than it was to hold
    NOT_IN_PROTOCOL = "not_in_protocol"  # an answer is not what the engine protocol returns
    INCOMPLETE = "incomplete"  # after a resume: never booted, or some of its actors are gone
    MIXED = "mixed"  # after a resume: its actors hold different versions

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class Refusal:
    """A refusal and its words (the journal keeps the words; the runtime counts the kinds)."""

    kind: RefusalKind
    detail: str

    def __str__(self) -> str:
        return self.detail


def refusal(
    launcher: Launcher,
    group: str,
    incarnation: int,
    booted: Booted,
    *,
    digest: str | None,
    canary: Canary | None,
) -> Refusal | None:
    """None if the process ``(group, incarnation)`` passes every gate it can, else why not.
    ``digest`` and ``canary``: what the weights given to it should show (None: unknown)."""
    by_digest = digest is not None and launcher.computes_digest
    if by_digest:
        assert digest is not None
        wrong = booted.digest_gate(digest)
        if wrong is not None:
            return Refusal(RefusalKind.DIGEST, wrong)
    if canary is None:
        if by_digest:
            return None
        return Refusal(
            RefusalKind.NO_EVIDENCE,
            "no admission evidence: the engine computes no digest and no canary was "
            "recorded with these weights (export with canary=canary.of_model(model))",
        )
    answers = launcher.ask(
        group,
        incarnation,
        lambda a: a.canary.remote(list(canary.prompt), len(canary.answer.tokens)),
    )
    if isinstance(answers, BootFailed):
        return Refusal(RefusalKind.CANARY, f"canary: no answer ({answers.reason})")
    for answer in answers:
        why = check(canary, answer)
        if why is not None:
            return Refusal(RefusalKind.CANARY, why)
    return None


def evidence(launcher: Launcher, digest: str | None, canary: Canary | None) -> str:
    """What a passed admission held the process to, in one line for the journal."""
    held = []
    if digest is not None and launcher.computes_digest:
        held.append(f"digest {digest[:23]}")
    if canary is not None:
        held.append(f"canary {len(canary.answer.tokens)} tokens agreed within {canary.dtype}")
    return ", ".join(held)


def manifest_canary(manifest: dict[str, Any]) -> Canary | None:
    """The canary a checkpoint's manifest records, if any. A record that is not one is a
    corrupt checkpoint: refused, as a digest that does not match is."""
    data = manifest.get("canary")
    if data is None:
        return None
    try:
        return Canary.from_json(data)
    except CanaryError as err:
        raise CanaryError(f"the manifest's canary: {err}") from err


def push_refusal(
    expected: Canary, digest: str | None, answers: tuple[Any, ...]
) -> Refusal | None:
    """Why a process's answers to a push (update, canary, per actor) refuse it, or None. An
    answer that is not what the protocol returns refuses that process only."""
    held, canaries = answers[0::2], answers[1::2]
    try:
        if digest is not None and (wrong := Booted(held).digest_gate(digest)):
            return Refusal(RefusalKind.DIGEST, wrong)
        for answer in canaries:
            why = check(expected, answer)
            if why is not None:
                return Refusal(RefusalKind.CANARY, why)
    except Exception as err:
        return Refusal(
            RefusalKind.NOT_IN_PROTOCOL,
            f"an answer not in the protocol: {type(err).__name__}: {err}",
        )
    return None
