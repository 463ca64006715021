"""Moved to ``recovery_fsm.search.replay`` (it checks journals against the world model, beside
it). This alias stays only while ``tests/test_ray_runtime.py`` still imports the old path;
delete it once that file imports ``recovery_fsm.search.replay``."""

from .search.replay import REAL, ReplayReport, rebuild, replay, rules_class

__all__ = ["REAL", "ReplayReport", "rebuild", "replay", "rules_class"]
