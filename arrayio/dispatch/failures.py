"""Which errors are a tool's failure, to fall back from, and which belong to the caller.

A data or environment error (a damaged file, a full disk, no memory, an interrupt) would
stop any tool the same way: it propagates at once and marks nothing. Anything else a tool
raises makes the policy mark that tool unavailable in the context and retry the whole
request with the next arm.
"""

from __future__ import annotations

import errno

from ..errors import FormatError, ToolUnavailableError

__all__ = ["chain", "is_tool_failure"]

# OSErrors about the file system, not the tool: no room, no quota, too large, read-only.
_ENVIRONMENT_ERRNOS = frozenset(
    code
    for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EFBIG, errno.EROFS)
    if code is not None
)


def is_tool_failure(error: BaseException) -> bool:
    """Whether ``error`` should make the dispatcher fall back to another tool.

    False for data and environment errors, which propagate: exceptions that are not an
    ``Exception`` (``KeyboardInterrupt``), :class:`~arrayio.errors.FormatError` and its
    subclasses, ``MemoryError`` (CuPy's ``OutOfMemoryError`` included), and an ``OSError``
    about the file system (``ENOSPC``, ``EDQUOT``, ``EFBIG``, ``EROFS``). True for anything
    else: :class:`~arrayio.errors.ToolUnavailableError`, other ``OSError`` (``EINVAL`` from
    ``O_DIRECT``), ``RuntimeError`` (KvikIO, CUDA), ``ImportError``, ``TypeError`` (a tool
    refusing a buffer), or a bug inside a tool.
    """
    if not isinstance(error, Exception):
        return False
    if isinstance(error, (FormatError, MemoryError)):
        return False
    if isinstance(error, OSError) and not isinstance(error, ToolUnavailableError):
        return error.errno not in _ENVIRONMENT_ERRNOS
    return True


def chain(error: BaseException, previous: BaseException | None) -> None:
    """Make ``previous`` the context at the end of ``error``'s chain (keeping its own), so
    that the last failure of a call that tried several tools shows the earlier ones."""
    if previous is None:
        return
    seen = set()
    tail = error
    while True:
        seen.add(id(tail))
        following = tail.__cause__ or tail.__context__
        if following is None or id(following) in seen:
            break
        tail = following
    if id(previous) not in seen:
        tail.__context__ = previous
        tail.__suppress_context__ = False
