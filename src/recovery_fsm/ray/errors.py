"""The runtime's own refusals: each says what was expected, and nothing was started or
pushed when it is raised."""

from __future__ import annotations

from typing import Any

import attrs

from .. import RecoveryConfig, RecoveryError


class AlreadyStarted(RecoveryError):
    """``start`` was called on a runtime that already started (or closed)."""


class VersionNotAbove(RecoveryError, ValueError):
    """A push or sync of a version not above the fleet's; nothing was pushed."""


class StartFailed(RecoveryError, RuntimeError):
    """``start`` could not boot a group or give it the first weights; the message carries
    the engine's own error. The runtime is left to ``close``."""


class BadRuntimeInput(RecoveryError, TypeError):
    """An argument of the runtime is not what it expects; nothing was started."""


def checked_options(
    config: RecoveryConfig, standby: Any, standby_push: Any, in_flight: Any
) -> RecoveryConfig:
    """The runtime's config with its ``standby`` count, once its options were checked."""
    from .rollouts import IN_FLIGHT_MODES

    if standby is not None:
        if type(standby) is not int or standby < 0:
            raise BadRuntimeInput(f"standby must be an int >= 0, got {standby!r}")
        config = attrs.evolve(config, standby=standby)
    if not isinstance(standby_push, bool):
        raise BadRuntimeInput(f"standby_push must be a bool, got {standby_push!r}")
    if in_flight not in IN_FLIGHT_MODES:
        raise BadRuntimeInput(f"in_flight must be one of {IN_FLIGHT_MODES}, got {in_flight!r}")
    return config
