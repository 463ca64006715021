"""Race search around the controller: a simulated world and an exhaustive explorer.
Hypothesis rules live in ``stateful`` (it needs the ``dev`` extra). The broken variants that
prove the search finds what it should are source patches in ``tests/property/variants.py``."""

from .explorer import Exploration, explore
from .sim import Action, Scope, Sim, small_config
from .world import World

__all__ = [
    "Action",
    "Exploration",
    "Scope",
    "Sim",
    "World",
    "explore",
    "small_config",
]
