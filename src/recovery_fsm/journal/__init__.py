"""The journal on disk (JSON lines), and what is read off it: the ledger of what happened
and the timeline picture (``timeline`` needs the ``[demo]`` extra)."""

from .jsonl import JsonlJournal, MixedJournal, mixed_journal, read_journal, trim_torn_tail
from .owner import JournalHeld, JournalOwner, owner_path

__all__ = [
    "JournalHeld",
    "JournalOwner",
    "JsonlJournal",
    "MixedJournal",
    "mixed_journal",
    "owner_path",
    "read_journal",
    "trim_torn_tail",
]
