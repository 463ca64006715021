"""An OpenAI-compatible HTTP front over a ``RecoveryRuntime``: clients that speak the
OpenAI API point their base URL at it, and every answer names the weights that made it."""

from .openai_front import FrontLimits, OpenAIFront, build_app

__all__ = ["FrontLimits", "OpenAIFront", "build_app"]
