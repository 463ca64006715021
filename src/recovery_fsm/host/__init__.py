"""Hosting a controller in-process for several threads: the link that stamps time and runs
effects off every lock, and the protocols every link and every controller host meet."""

from .link import ControllerLink, ControllerQueries, EffectError, FailedEffects, Link

__all__ = ["ControllerLink", "ControllerQueries", "EffectError", "FailedEffects", "Link"]
