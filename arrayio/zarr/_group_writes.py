"""Writes of many store keys committed as groups: every value of a group is staged in its
temporary file at once (written and fsynced on the I/O pool), then each is renamed over its
key, and each directory is fsynced once.

A group holds a descriptor and a temporary file for each of its keys until they are renamed
(the descriptor's lock tells a cleaner that the temporary is a live writer's), so groups are
bounded (:func:`group_keys`): a write of a million chunks neither exhausts the process's
descriptors nor needs the disk space of every chunk twice.
"""

from __future__ import annotations

import concurrent.futures
import os
import resource
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from zarr.core.buffer import Buffer

from ._io_pool import executor, in_io_thread
from ._keys import split_key
from ._writes import discard_at, publish_at, stage_at, sync_directory

__all__ = ["GROUP_KEYS", "commit_group", "group_keys"]

GROUP_KEYS = 256


def group_keys() -> int:
    """How many keys a group holds: :data:`GROUP_KEYS`, or a quarter of the descriptors this
    process may open where that is fewer (the rest stay for the program, and the
    dispatcher's tools)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return GROUP_KEYS
    return max(1, min(GROUP_KEYS, soft // 4))


def commit_group(
    directories: Mapping[str, int], writes: Sequence[tuple[str, Buffer]], root: str
) -> None:
    """Store each ``(key, value)`` of ``writes`` (at most :func:`group_keys`), its folder
    open in ``directories``: all staged, then all renamed into place. A value that fails to
    stage (or an interrupt while they stage) leaves every key of the group as it was, its
    temporaries removed; a rename that fails leaves the keys renamed before it replaced,
    and those renames durable."""
    futures: list[concurrent.futures.Future[tuple[str, int]]] = []
    renaming = False
    try:
        for key, value in writes:
            folder, name = split_key(key)
            path = os.path.join(root, key)
            futures.append(_start(stage_at, directories[folder], name, value, path))
        concurrent.futures.wait(futures)
        for future in futures:
            error = future.exception()
            if error is not None:
                raise error
        renaming = True  # from here on, the directories are synced whatever happens
        for (key, _), future in zip(writes, futures, strict=True):
            temporary, _ = future.result()
            folder, name = split_key(key)
            publish_at(directories[folder], temporary, name, False, os.path.join(root, key))
    finally:
        concurrent.futures.wait(futures)  # nothing left staging behind an interrupt
        # futures may be fewer than writes: an interrupt can stop the loop that starts them
        for (key, _), future in zip(writes, futures, strict=False):
            if future.exception() is not None:
                continue  # stage_at left nothing behind
            temporary, fd = future.result()
            # Closed, and removed unless it was renamed into place (then it is gone).
            discard_at(directories[split_key(key)[0]], temporary, fd)
        if renaming:
            for directory in directories.values():
                sync_directory(directory)


def _start(function: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
    """``function(*args)`` on the I/O pool; in the caller's thread where that is one of the
    pool's own (waiting there for the pool could wait for itself)."""
    if not in_io_thread():
        return executor().submit(function, *args)
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    try:
        future.set_result(function(*args))
    except Exception as error:  # noqa: BLE001 - handed to the caller as the pool would
        future.set_exception(error)
    return future
