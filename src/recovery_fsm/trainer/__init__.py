"""Trainer hooks: what a trainer calls around each weight sync, and its recovery metrics."""

from .hooks import Closed, HookOrderError, RecoveryHooks, Runtime

__all__ = ["Closed", "HookOrderError", "RecoveryHooks", "Runtime"]
