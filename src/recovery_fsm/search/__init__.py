"""Race search around the controller: a simulated world, an exhaustive explorer, broken
variants to prove the search finds what it should. Hypothesis rules live in ``stateful``
(it needs the ``dev`` extra)."""

from .explorer import Exploration, explore
from .mutants import HOSTING_MUTANTS, MUTANTS
from .sim import Action, Scope, Sim, small_config
from .world import World

__all__ = [
    "HOSTING_MUTANTS",
    "MUTANTS",
    "Action",
    "Exploration",
    "Scope",
    "Sim",
    "World",
    "explore",
    "small_config",
]
