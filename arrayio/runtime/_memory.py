"""How much host memory a load may take: what the kernel says is available, within the
container's limit.

A load fills every byte it allocates, so an allocation that overcommit lets through would
end with the kernel's out-of-memory killer instead of an error. Checking first turns a file
that claims more than the machine holds (a hostile header, a sparse file) into
:class:`~arrayio.errors.OutOfMemoryError` before anything large is allocated.
"""

from __future__ import annotations

import contextlib
import time

__all__ = ["available_host_bytes"]

# Where cgroup v2 and v1 keep a container's memory limit and use (the process's own cgroup
# under a cgroup namespace, as containers have).
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def _meminfo_bytes(*fields: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            values = {
                name: int(rest.split()[0]) * 1024
                for name, _, rest in (line.partition(":") for line in meminfo)
                if name in fields
            }
    except (OSError, ValueError, IndexError):
        return None
    return sum(values.values()) if values else None


def _read_int(path: str) -> int | None:
    with contextlib.suppress(OSError, ValueError), open(path, encoding="ascii") as file:
        return int(file.read().strip())  # "max" (no limit) fails to parse: None
    return None


_last: tuple[float, int | None] = (-1e9, None)  # (monotonic time, bytes) of the last reading


def available_host_bytes(max_age: float = 0.0) -> int | None:
    """Bytes of host memory this process can still fill, or None where unknown (not Linux).

    The kernel's ``MemAvailable`` plus free swap, bounded by the container's memory limit
    less what the container already uses. ``max_age``: a reading up to that many seconds
    old will do (reading costs tens of microseconds, too much for every transfer).
    """
    global _last
    now = time.monotonic()
    if now - _last[0] <= max_age:
        return _last[1]
    available = _read_available()
    _last = (now, available)
    return available


def _read_available() -> int | None:
    available = _meminfo_bytes("MemAvailable", "SwapFree")
    for limit_file, usage_file in _CGROUP_FILES:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:
            room = max(0, limit - usage)
            available = room if available is None else min(available, room)
    return available
