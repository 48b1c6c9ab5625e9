"""``python -m arrayio``: the ``arrayio`` command (see :mod:`arrayio.cli`)."""

from __future__ import annotations

from .cli import main

raise SystemExit(main())
