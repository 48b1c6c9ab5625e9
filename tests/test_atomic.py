"""Atomic writes: a save either replaces the file completely or leaves the old one untouched.

arrayio writes to a hidden temporary file in the same directory (``.NAME.arrayio-tmp-*``),
fsyncs it and renames it over the target. These tests check that

* a writer killed outright (SIGKILL) mid-save leaves the old file intact and loadable;
* a save that fails in Python (bad input, an I/O error, an interrupt) leaves the old file
  byte-identical and removes its temporary file;
* a successful save replaces the file, leaves no temporary file, and creates the file with
  the mode the umask gives (not mkstemp's 0o600);

for both the safetensors container and ``.npy``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import arrayio

TEMP_MARKER = ".arrayio-tmp-"

OLD = {"w": np.arange(1000, dtype=np.float32), "step": np.array(7, dtype=np.int64)}
NEW = {"w": -np.arange(3000, dtype=np.float32), "b": np.ones((4, 5), np.int16),
       "c": np.arange(7, dtype=np.uint8)}
OLD_NPY = np.arange(1000, dtype=np.float64)
NEW_NPY = -np.arange(5000, dtype=np.float64)


def temp_files(directory: Path) -> list[Path]:
    """arrayio's temporary files in ``directory``."""
    return sorted(p for p in directory.iterdir() if TEMP_MARKER in p.name)


def assert_tree_equal(loaded: dict[str, Any], expected: dict[str, np.ndarray]) -> None:
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype, key
        np.testing.assert_array_equal(loaded[key], value)


@pytest.fixture
def umask() -> Iterator[Callable[[int], None]]:
    """Set the process umask for one test, restoring it afterwards."""
    original = os.umask(0o022)  # the only way to read the umask is to set it
    os.umask(original)
    yield lambda mask: os.umask(mask)
    os.umask(original)


# --------------------------------------------------------------------------- killed writer

# Saves a large uint8 array to argv[1]; killed by the test before it can finish.
WRITER = """
import sys
import numpy as np
import arrayio
path, nbytes = sys.argv[1], int(sys.argv[2])
arrayio.save(path, {"big": np.ones(nbytes, dtype=np.uint8)})
"""

# Kill only once the temporary file holds real data, not just the moment it is created.
KILL_AFTER_BYTES = 1 << 20
ATTEMPT_SIZES = (400 << 20, 800 << 20, 1600 << 20)
ATTEMPT_DEADLINE_S = 30


def kill_writer_mid_save(path: Path, nbytes: int, log: Path, seen: list[str]) -> bool:
    """Run WRITER for ``path`` and SIGKILL it while its temporary file is still in place.

    Returns True when the writer was killed before renaming its temporary file, False when it
    got to the rename first (the caller retries with a larger array). The names of the
    temporary files seen go to ``seen``.
    """
    with open(log, "wb") as stderr:
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(nbytes)],
                                  stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + ATTEMPT_DEADLINE_S
        while time.monotonic() < deadline:
            if writer.poll() is not None:
                if writer.returncode != 0:
                    pytest.fail(f"writer crashed ({writer.returncode}):\n{log.read_text()}")
                return False  # finished before we saw enough of its temporary file
            for temp in temp_files(path.parent):
                seen.append(temp.name)
                try:
                    grown = temp.stat().st_size >= KILL_AFTER_BYTES
                except FileNotFoundError:  # renamed between listing and stat
                    continue
                if grown:
                    os.kill(writer.pid, signal.SIGKILL)
                    writer.wait()
                    # If the temporary file is still there, the rename had not happened:
                    # the kill really came mid-save.
                    return writer.returncode == -signal.SIGKILL and temp.exists()
            time.sleep(0.001)
        pytest.fail(f"no temporary file of {KILL_AFTER_BYTES} bytes appeared within "
                    f"{ATTEMPT_DEADLINE_S} s; writer log:\n{log.read_text()}")
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_writer_killed_mid_save_leaves_old_file(tmp_path: Path) -> None:
    directory = tmp_path / "data"
    directory.mkdir()
    path = directory / "model.safetensors"
    arrayio.save(path, OLD)
    old_bytes = path.read_bytes()

    seen: list[str] = []
    for nbytes in ATTEMPT_SIZES:
        # A writer that got as far as the rename replaced the file; start again from the old.
        path.write_bytes(old_bytes)
        for temp in temp_files(directory):
            temp.unlink()
        if kill_writer_mid_save(path, nbytes, tmp_path / "writer.log", seen):
            break
    else:
        if not seen:
            pytest.fail(f"no save (up to {ATTEMPT_SIZES[-1]} bytes) ever created a temporary "
                        f"file named *{TEMP_MARKER}*: the save is not written atomically")
        pytest.fail(f"the writer finished every save before it could be killed (up to "
                    f"{ATTEMPT_SIZES[-1]} bytes): this machine is too fast for this test")

    assert path.read_bytes() == old_bytes
    assert_tree_equal(arrayio.load(path, verify=True), OLD)
    # SIGKILL gives no chance to clean up: the partial temporary file is left behind...
    assert temp_files(directory), "expected the killed writer's temporary file to remain"
    # ...and does not get in the way of the next save.
    arrayio.save(path, NEW)
    assert_tree_equal(arrayio.load(path), NEW)


# --------------------------------------------------------------------------- failing saves


class InjectedFailure(Exception):
    """Raised by the tests' failure injections."""


def fail_after(calls: int, real: Callable[..., Any], error: BaseException,
               directory: Path, seen_temp: list[bool]) -> Callable[..., Any]:
    """Wrap ``real`` so that call number ``calls + 1`` raises ``error``, recording whether a
    temporary file existed at that moment (the failure really came mid-save)."""
    count = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        if count > calls:
            seen_temp.append(bool(temp_files(directory)))
            raise error
        return real(*args, **kwargs)

    return wrapper


# Each injection patches one step of a save to fail; it gets the monkeypatch fixture, the
# directory and a list in which the patched step records whether a temporary file existed.
Injection = Callable[[pytest.MonkeyPatch, Path, list[bool]], None]


def _fail_write_from(calls: int, error: BaseException) -> Injection:
    """Array writes fail after ``calls`` arrays: ``.npy`` saves write their array alone
    (``write_from``), containers all of theirs as one batch (``write_many``), of which the
    first ``calls`` are written before the error."""
    def inject(monkeypatch: pytest.MonkeyPatch, directory: Path, seen: list[bool]) -> None:
        real = arrayio._transfer.write_from
        monkeypatch.setattr(arrayio._transfer, "write_from",
                            fail_after(calls, real, error, directory, seen))
        real_many = arrayio._transfer.write_many

        def write_many(fd: int, requests: Any, **kwargs: Any) -> Any:
            real_many(fd, requests[:calls], **kwargs)
            seen.append(bool(temp_files(directory)))
            raise error

        monkeypatch.setattr(arrayio._transfer, "write_many", write_many)

    return inject


def _fail_header_write(monkeypatch: pytest.MonkeyPatch, directory: Path,
                       seen: list[bool]) -> None:
    real = arrayio._api._write_all
    monkeypatch.setattr(arrayio._api, "_write_all",
                        fail_after(0, real, InjectedFailure("header"), directory, seen))


def _fail_fsync(monkeypatch: pytest.MonkeyPatch, directory: Path, seen: list[bool]) -> None:
    monkeypatch.setattr(os, "fsync",
                        fail_after(0, os.fsync, OSError(5, "fsync failed"), directory, seen))


def _fail_rename(monkeypatch: pytest.MonkeyPatch, directory: Path, seen: list[bool]) -> None:
    monkeypatch.setattr(os, "replace",
                        fail_after(0, os.replace, OSError(18, "rename failed"), directory, seen))


CONTAINER_FAILURES = [
    pytest.param(_fail_write_from(1, InjectedFailure("disk full")), InjectedFailure,
                 id="second-array-write"),
    pytest.param(_fail_write_from(1, KeyboardInterrupt()), KeyboardInterrupt,
                 id="interrupt-mid-write"),
    pytest.param(_fail_header_write, InjectedFailure, id="header-write"),
    pytest.param(_fail_fsync, OSError, id="fsync"),
    pytest.param(_fail_rename, OSError, id="rename"),
]

NPY_FAILURES = [
    pytest.param(_fail_write_from(0, InjectedFailure("disk full")), InjectedFailure,
                 id="data-write"),
    pytest.param(_fail_write_from(0, KeyboardInterrupt()), KeyboardInterrupt,
                 id="interrupt-mid-write"),
    pytest.param(_fail_header_write, InjectedFailure, id="header-write"),
    pytest.param(_fail_fsync, OSError, id="fsync"),
    pytest.param(_fail_rename, OSError, id="rename"),
]


@pytest.mark.parametrize(("inject", "error"), CONTAINER_FAILURES)
def test_failed_container_save_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inject: Injection, error: type
) -> None:
    path = tmp_path / "model.safetensors"
    arrayio.save(path, OLD)
    old_bytes = path.read_bytes()
    seen_temp: list[bool] = []
    inject(monkeypatch, tmp_path, seen_temp)

    with pytest.raises(error):
        arrayio.save(path, NEW)
    monkeypatch.undo()

    assert seen_temp == [True], "the injected failure did not happen while a temp file existed"
    assert path.read_bytes() == old_bytes
    assert temp_files(tmp_path) == []
    assert_tree_equal(arrayio.load(path), OLD)


@pytest.mark.parametrize(("inject", "error"), NPY_FAILURES)
def test_failed_npy_save_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inject: Injection, error: type
) -> None:
    path = tmp_path / "x.npy"
    arrayio.save(path, OLD_NPY)
    old_bytes = path.read_bytes()
    seen_temp: list[bool] = []
    inject(monkeypatch, tmp_path, seen_temp)

    with pytest.raises(error):
        arrayio.save(path, NEW_NPY)
    monkeypatch.undo()

    assert seen_temp == [True], "the injected failure did not happen while a temp file existed"
    assert path.read_bytes() == old_bytes
    assert temp_files(tmp_path) == []
    np.testing.assert_array_equal(arrayio.load(path), OLD_NPY)


@pytest.mark.parametrize(
    ("name", "old", "new", "error"),
    [
        pytest.param("model.safetensors", OLD, {**NEW, "bad": object()},
                     arrayio.UnsupportedObjectError, id="container-unsupported-leaf"),
        pytest.param("model.safetensors", OLD, {"w": np.array(["text"])},
                     arrayio.UnsupportedDtypeError, id="container-unsupported-dtype"),
        pytest.param("model.safetensors", OLD, NEW | {"__metadata__": np.ones(1)},
                     arrayio.UnsupportedObjectError, id="container-reserved-key"),
        pytest.param("x.npy", OLD_NPY, {"a": NEW_NPY}, arrayio.UnsupportedObjectError,
                     id="npy-not-an-array"),
        pytest.param("x.npy", OLD_NPY, np.array([object()]), arrayio.UnsupportedDtypeError,
                     id="npy-object-dtype"),
    ],
)
def test_rejected_input_keeps_old_file(tmp_path: Path, name: str, old: Any, new: Any,
                                       error: type) -> None:
    path = tmp_path / name
    arrayio.save(path, old)
    old_bytes = path.read_bytes()
    with pytest.raises(error):
        arrayio.save(path, new)
    assert path.read_bytes() == old_bytes
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("name", ["model.safetensors", "x.npy"])
def test_failed_first_save_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           name: str) -> None:
    _fail_write_from(0, InjectedFailure("disk full"))(monkeypatch, tmp_path, [])
    with pytest.raises(InjectedFailure):
        arrayio.save(tmp_path / name, NEW_NPY if name.endswith(".npy") else NEW)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- successful saves


def test_save_replaces_container(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    arrayio.save(path, OLD)
    with arrayio.open(path) as reader:
        arrayio.save(path, NEW)
        # The reader holds the old file, which the rename unlinked but did not change.
        assert_tree_equal(reader.load(), OLD)
    assert_tree_equal(arrayio.load(path), NEW)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_save_replaces_npy(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    arrayio.save(path, OLD_NPY)
    arrayio.save(path, NEW_NPY)
    np.testing.assert_array_equal(arrayio.load(path), NEW_NPY)
    np.testing.assert_array_equal(np.load(path), NEW_NPY)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]


@pytest.mark.parametrize("name", ["model.safetensors", "x.npy"])
@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077], ids=oct)
def test_new_file_mode_honours_umask(tmp_path: Path, umask: Callable[[int], None], name: str,
                                     mask: int) -> None:
    umask(mask)
    path = tmp_path / name
    arrayio.save(path, NEW_NPY if name.endswith(".npy") else NEW)
    # As open(path, "w") would create it: 0o666 less the umask (0o644 under 0o022).
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("durable", [True, False])
def test_only_a_durable_replacement_waits_for_the_disk(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       durable: bool) -> None:
    from arrayio import _atomic

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(_atomic.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    path = tmp_path / "cache.json"
    path.write_bytes(b"old")
    with _atomic.atomic_write(path, durable=durable) as fd:
        os.write(fd, b"new content")
    assert path.read_bytes() == b"new content"
    assert temp_files(tmp_path) == []
    assert len(synced) == (2 if durable else 0)  # the file, then its directory
    # Not durable is still atomic: a failure inside leaves the old content.
    with pytest.raises(InjectedFailure), _atomic.atomic_write(path, durable=durable) as fd:
        os.write(fd, b"half")
        raise InjectedFailure("interrupted")
    assert path.read_bytes() == b"new content"
    assert temp_files(tmp_path) == []
