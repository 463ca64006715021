"""``python -m recovery_fsm.cli``: the ``recovery-fsm`` command."""

from . import main

raise SystemExit(main())
