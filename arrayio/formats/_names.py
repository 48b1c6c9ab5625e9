"""Looking names up by subtree: a name itself and the names below it (``"model.layers.0"``
names ``"model.layers.0.weight"``), in their saved order, without scanning every name for
each one looked up (a checkpoint's shards, or a rank's list of hundreds of keys, would take
a time quadratic in the names)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence


class Names:
    """``names`` in their saved order (a name given twice keeps its first place)."""

    def __init__(self, names: Iterable[str]) -> None:
        self._position: dict[str, int] = {}
        for i, name in enumerate(names):
            self._position.setdefault(name, i)
        self._sorted = sorted(self._position)

    def below(self, key: str, separators: Sequence[str] = (".",)) -> list[str]:
        """``key`` where it is a name, and every name that starts with ``key`` and one of
        ``separators``, in the saved order; empty where there is none."""
        found = [key] if key in self._position else []
        for separator in separators:
            prefix = key + separator
            at = bisect.bisect_left(self._sorted, prefix)
            while at < len(self._sorted) and self._sorted[at].startswith(prefix):
                found.append(self._sorted[at])
                at += 1
        found.sort(key=self._position.__getitem__)
        return found
