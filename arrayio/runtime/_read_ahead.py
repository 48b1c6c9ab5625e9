"""Ask the kernel for a module's files before importing it.

An import reads its files by page faults (the shared libraries it loads) and small reads
(its Python files), one after another, holding the interpreter's lock. Where those files
are not in the page cache (a machine that just started, or any cold start that dropped the
caches) and a cold load's large reads fill the disk's queue, each of them waits behind
those reads: an import of tens of milliseconds then outlasts the load, holding the lock
the next load's workers need. A tool set up in the background beside a cold load (see
``arrayio.dispatch.policy``) asks for its files here, on the caller's thread, before the
load's reads start: every file at once (``POSIX_FADV_WILLNEED`` starts their reads and
does not wait for them), so that the disk serves them ahead of the load's requests.
Reading them in from the set-up's own thread, once the load's reads had started, moved
the import's cost into the reloads instead (``docs/design/dispatcher.md``).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import stat
from collections.abc import Iterable
from typing import Any

__all__ = ["ask_for", "files_of"]

_SUFFIXES = (".py", ".pyc", ".so", ".pyx", ".pxd", ".json")


def _spec(module: str) -> Any:
    """``module``'s spec, found without importing it (only its parent packages are); None
    where it is not found or a parent fails to import (that module alone is lost)."""
    try:
        return importlib.util.find_spec(module)
    except Exception:  # noqa: BLE001 - a broken parent package: nothing to ask for here
        return None


def _module_files(origin: str | None) -> list[str]:
    """A plain module's source (or extension) and its compiled bytecode."""
    if not origin or not os.path.isfile(origin):
        return []
    files = [origin]
    if origin.endswith(".py"):
        try:
            files.append(importlib.util.cache_from_source(origin))
        except NotImplementedError:
            pass
    return files


def files_of(modules: Iterable[str]) -> list[str]:
    """The files importing ``modules`` reads, as far as they can be found without importing
    them: a package's every file under its directory (shared libraries, Python sources and
    their bytecode), the libraries its wheel vendors beside it (``<distribution>.libs``,
    auditwheel's), and a plain module's source and bytecode."""
    found: list[str] = []
    for module in modules:
        spec = _spec(module)
        if spec is None:
            continue
        if not spec.submodule_search_locations:
            found.extend(_module_files(spec.origin))
            continue
        directory = list(spec.submodule_search_locations)[0]
        parent = os.path.dirname(directory)
        vendored = os.path.join(parent, glob.escape(os.path.basename(directory)) + "*.libs")
        folders = [directory, *glob.glob(vendored)]
        for folder in folders:
            for root, _, names in os.walk(folder):
                found.extend(
                    os.path.join(root, name)
                    for name in names
                    if name.endswith(_SUFFIXES) or ".so." in name
                )
    return sorted(set(found))


def ask_for(paths: Iterable[str]) -> int:
    """Ask the kernel to read ``paths`` into the page cache (``POSIX_FADV_WILLNEED``: their
    reads start, and nothing waits for them); return how many files were asked for. Files
    that cannot be opened are skipped: this only makes a later import faster."""
    asked = 0
    for path in paths:
        try:  # (not blocking: a FIFO named like a library must not hang the load)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            asked += 1
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)
    return asked
