"""A full disk: a save that does not fit fails cleanly.

The tests mount a 2 MiB tmpfs (root only; skipped with the reason where mounting is not
allowed), save a small file, then save something that does not fit beside it. Required:

* the error is ``arrayio.DiskFullError``: an ``ArrayioError`` and an ``OSError`` with
  ``errno == ENOSPC``;
* its message names the user's path, not the temporary file's;
* the previous file still loads, unchanged;
* no temporary file is left behind.

For ``save``, ``save_async`` (the error comes out of ``future.result()``) and a chunk write
through :class:`arrayio.zarr.NVMeStore`.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import arrayio

SIZE = "2m"
OLD = {"w": np.arange(256 << 10, dtype=np.float32)}  # 1 MiB: fits
NEW = {"w": np.arange(384 << 10, dtype=np.float32)}  # 1.5 MiB: not beside the old file


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a fresh 2 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if (
            subprocess.run(
                ["umount", str(mount_point)], capture_output=True, check=False
            ).returncode
            != 0
        ):
            subprocess.run(["umount", "-l", str(mount_point)], check=False)


def problems_with(error: BaseException | None, path: Path) -> list[str]:
    """What the error of a save that did not fit gets wrong (empty: all is well)."""
    if error is None:
        return ["no error: the save that cannot fit reported success"]
    problems = []
    disk_full = getattr(arrayio, "DiskFullError", None)
    if disk_full is None:
        problems.append("arrayio.DiskFullError does not exist")
    elif not isinstance(error, disk_full):
        problems.append(f"{type(error).__name__} is not arrayio.DiskFullError")
    if not isinstance(error, arrayio.ArrayioError):
        problems.append(f"{type(error).__name__} is not an arrayio.ArrayioError")
    if not isinstance(error, OSError) or error.errno != errno.ENOSPC:
        problems.append(f"not an OSError with errno ENOSPC: {error!r}")
    message = str(error)
    if str(path) not in message:
        problems.append(f"the message does not name {path}: {message!r}")
    if ".arrayio-tmp-" in message:
        problems.append(f"the message names a temporary file: {message!r}")
    return problems


def check_aftermath(problems: list[str], directory: Path, faults: ModuleType) -> None:
    left = faults.temporaries(directory)
    if left:
        problems.append(f"temporary files left: {[p.name for p in left]}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", ["old.safetensors", "old.npy"])
def test_save_that_does_not_fit(full_disk: Path, faults: ModuleType, name: str) -> None:
    path = full_disk / name
    old, new = (OLD, NEW) if name.endswith(".safetensors") else (OLD["w"], NEW["w"])
    arrayio.save(path, old)
    error = None
    try:
        arrayio.save(path, new)
    except Exception as caught:  # noqa: BLE001 - its class is what is checked
        error = caught
    problems = problems_with(error, path)
    faults.assert_arrays_equal(arrayio.load(path), old, name)
    check_aftermath(problems, full_disk, faults)


def test_save_async_that_does_not_fit(full_disk: Path, faults: ModuleType) -> None:
    path = full_disk / "old.safetensors"
    arrayio.save(path, OLD)
    future = arrayio.save_async(path, NEW)
    error = future.exception(timeout=60)
    problems = problems_with(error, path)
    faults.assert_arrays_equal(arrayio.load(path), OLD, path.name)
    check_aftermath(problems, full_disk, faults)


def test_zarr_chunk_write_that_does_not_fit(full_disk: Path, faults: ModuleType) -> None:
    import zarr

    from arrayio.zarr import NVMeStore

    old = np.arange(384 << 10, dtype=np.float32)  # one uncompressed chunk of 1.5 MiB
    array = zarr.create_array(
        NVMeStore(full_disk), shape=old.shape, chunks=old.shape, dtype="float32", compressors=None
    )
    array[...] = old
    error: Any = None
    try:
        array[...] = -old
    except Exception as caught:  # noqa: BLE001 - its class is what is checked
        error = caught
    # The store's root, or the chunk's path below it.
    problems = problems_with(error, full_disk)
    np.testing.assert_array_equal(zarr.open_array(NVMeStore(full_disk), mode="r")[...], old)
    check_aftermath(problems, full_disk, faults)
