"""Bring a module's files into the page cache before importing it.

An import reads its files by page faults (the shared libraries it loads) and small reads
(its Python files), one after another, holding the interpreter's lock. Where those files
are not in the page cache (a machine that just started, or any cold start that dropped the
caches) and the disk is busy with a cold load's large reads, each of them waits behind
those reads: an import that takes tens of milliseconds from the page cache then takes a
second, and every thread of the process that needs the interpreter's lock waits with it,
the transfers' workers included. A tool set up in the background beside a cold load (see
``arrayio.dispatch.policy``) reads its files here first: all of them asked of the kernel at
once (``POSIX_FADV_WILLNEED``), then read through with the interpreter's lock released, so
that the import itself finds them in the page cache.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Iterable

__all__ = ["files_of", "read_ahead"]

_PIECE = 1 << 20  # bytes per read while reading a file through
_SUFFIXES = (".py", ".pyc", ".so", ".pyx", ".pxd", ".json")


def _package_dir(module: str) -> str | None:
    """The directory of ``module``'s package, or None where it is a plain module or not
    found (found without being imported: only its parent packages are)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    locations = list(spec.submodule_search_locations)
    return locations[0] if locations else None


def _module_files(module: str) -> list[str]:
    """A plain module's source and compiled bytecode."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return []
    files = [spec.origin]
    if spec.origin.endswith(".py"):
        try:
            files.append(importlib.util.cache_from_source(spec.origin))
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
        directory = _package_dir(module)
        if directory is None:
            found.extend(_module_files(module))
            continue
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


def read_ahead(paths: Iterable[str]) -> int:
    """Read ``paths`` into the page cache (every file asked of the kernel first, so that the
    disk serves them together); return the bytes read. Files that cannot be opened are
    skipped: this only makes a later import faster."""
    opened: list[int] = []
    try:
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            opened.append(fd)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except (OSError, AttributeError):
                pass
        total = 0
        buffer = bytearray(_PIECE)
        for fd in opened:
            offset = 0
            while True:
                try:
                    got = os.preadv(fd, [buffer], offset)
                except OSError:
                    break
                if got <= 0:
                    break
                offset += got
            total += offset
        return total
    finally:
        for fd in opened:
            os.close(fd)
