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

import errno
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import arrayio
from arrayio.dispatch import _transfer
from arrayio.integrity import _atomic

TEMP_MARKER = ".arrayio-tmp-"

OLD = {"w": np.arange(1000, dtype=np.float32), "step": np.array(7, dtype=np.int64)}
NEW = {
    "w": -np.arange(3000, dtype=np.float32),
    "b": np.ones((4, 5), np.int16),
    "c": np.arange(7, dtype=np.uint8),
}
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
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), str(nbytes)],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
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
        pytest.fail(
            f"no temporary file of {KILL_AFTER_BYTES} bytes appeared within "
            f"{ATTEMPT_DEADLINE_S} s; writer log:\n{log.read_text()}"
        )
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
            pytest.fail(
                f"no save (up to {ATTEMPT_SIZES[-1]} bytes) ever created a temporary "
                f"file named *{TEMP_MARKER}*: the save is not written atomically"
            )
        pytest.fail(
            f"the writer finished every save before it could be killed (up to "
            f"{ATTEMPT_SIZES[-1]} bytes): this machine is too fast for this test"
        )

    assert path.read_bytes() == old_bytes
    assert_tree_equal(arrayio.load(path, verify=True), OLD)
    # SIGKILL gives no chance to clean up: the partial temporary file is left behind...
    assert temp_files(directory), "expected the killed writer's temporary file to remain"
    # ...and the next save into the directory removes it, since its writer is dead.
    arrayio.save(path, NEW)
    assert_tree_equal(arrayio.load(path), NEW)
    assert temp_files(directory) == []


# --------------------------------------------------------------------------- failing saves


class InjectedFailure(Exception):
    """Raised by the tests' failure injections."""


def fail_after(
    calls: int,
    real: Callable[..., Any],
    error: BaseException,
    directory: Path,
    seen_temp: list[bool],
) -> Callable[..., Any]:
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
        real = arrayio.dispatch._transfer.write_from
        monkeypatch.setattr(
            arrayio.dispatch._transfer,
            "write_from",
            fail_after(calls, real, error, directory, seen),
        )
        real_many = arrayio.dispatch._transfer.write_many

        def write_many(fd: int, requests: Any, **kwargs: Any) -> Any:
            real_many(fd, requests[:calls], **kwargs)
            seen.append(bool(temp_files(directory)))
            raise error

        monkeypatch.setattr(arrayio.dispatch._transfer, "write_many", write_many)

    return inject


def _fail_header_write(monkeypatch: pytest.MonkeyPatch, directory: Path, seen: list[bool]) -> None:
    real = arrayio.api._save._write_all
    monkeypatch.setattr(
        arrayio.api._save,
        "_write_all",
        fail_after(0, real, InjectedFailure("header"), directory, seen),
    )


def _fail_fsync(monkeypatch: pytest.MonkeyPatch, directory: Path, seen: list[bool]) -> None:
    monkeypatch.setattr(
        os, "fsync", fail_after(0, os.fsync, OSError(5, "fsync failed"), directory, seen)
    )


def _fail_rename(monkeypatch: pytest.MonkeyPatch, directory: Path, seen: list[bool]) -> None:
    monkeypatch.setattr(
        os, "replace", fail_after(0, os.replace, OSError(18, "rename failed"), directory, seen)
    )


CONTAINER_FAILURES = [
    pytest.param(
        _fail_write_from(1, InjectedFailure("disk full")), InjectedFailure, id="second-array-write"
    ),
    pytest.param(
        _fail_write_from(1, KeyboardInterrupt()), KeyboardInterrupt, id="interrupt-mid-write"
    ),
    pytest.param(_fail_header_write, InjectedFailure, id="header-write"),
    pytest.param(_fail_fsync, OSError, id="fsync"),
    pytest.param(_fail_rename, OSError, id="rename"),
]

NPY_FAILURES = [
    pytest.param(
        _fail_write_from(0, InjectedFailure("disk full")), InjectedFailure, id="data-write"
    ),
    pytest.param(
        _fail_write_from(0, KeyboardInterrupt()), KeyboardInterrupt, id="interrupt-mid-write"
    ),
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
        pytest.param(
            "model.safetensors",
            OLD,
            {**NEW, "bad": object()},
            arrayio.UnsupportedObjectError,
            id="container-unsupported-leaf",
        ),
        pytest.param(
            "model.safetensors",
            OLD,
            {"w": np.array(["text"])},
            arrayio.UnsupportedDtypeError,
            id="container-unsupported-dtype",
        ),
        pytest.param(
            "model.safetensors",
            OLD,
            NEW | {"__metadata__": np.ones(1)},
            arrayio.UnsupportedObjectError,
            id="container-reserved-key",
        ),
        pytest.param(
            "x.npy", OLD_NPY, {"a": NEW_NPY}, arrayio.UnsupportedObjectError, id="npy-not-an-array"
        ),
        pytest.param(
            "x.npy",
            OLD_NPY,
            np.array([object()]),
            arrayio.UnsupportedDtypeError,
            id="npy-object-dtype",
        ),
    ],
)
def test_rejected_input_keeps_old_file(
    tmp_path: Path, name: str, old: Any, new: Any, error: type
) -> None:
    path = tmp_path / name
    arrayio.save(path, old)
    old_bytes = path.read_bytes()
    with pytest.raises(error):
        arrayio.save(path, new)
    assert path.read_bytes() == old_bytes
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("name", ["model.safetensors", "x.npy"])
def test_failed_first_save_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
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
def test_new_file_mode_honours_umask(
    tmp_path: Path, umask: Callable[[int], None], name: str, mask: int
) -> None:
    umask(mask)
    path = tmp_path / name
    arrayio.save(path, NEW_NPY if name.endswith(".npy") else NEW)
    # As open(path, "w") would create it: 0o666 less the umask (0o644 under 0o022).
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("durable", [True, False])
def test_only_a_durable_replacement_waits_for_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    from arrayio.integrity import _atomic

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


# --------------------------------------------------------------------------- temporaries


# Holds a temporary open inside atomic_write until its stdin closes: a live writer.
LIVE_WRITER = """
import sys
from arrayio.integrity import _atomic
with _atomic.atomic_write(sys.argv[1]) as fd:
    print("writing", flush=True)
    sys.stdin.read()
"""


def test_a_live_writers_temporary_survives_anothers_cleanup(tmp_path: Path) -> None:
    target = tmp_path / "live.safetensors"
    writer = subprocess.Popen(
        [sys.executable, "-c", LIVE_WRITER, str(target)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert writer.stdout.readline() == b"writing\n"
        (live,) = temp_files(tmp_path)
        assert f"{TEMP_MARKER}{writer.pid}-" in live.name  # says which process owns it
        arrayio.save(tmp_path / "other.safetensors", NEW)  # cleans the directory
        assert _atomic.remove_stale_temporaries(tmp_path) == []
        assert temp_files(tmp_path) == [live]
    finally:
        writer.communicate(b"")
    assert writer.returncode == 0
    assert target.exists() and temp_files(tmp_path) == []


def test_a_temporary_left_by_a_dead_process_is_removed(tmp_path: Path) -> None:
    # What a killed writer leaves: a temporary file nobody holds a lock on.
    stale = tmp_path / f".model.safetensors{TEMP_MARKER}12345-0123456789ab"
    stale.write_bytes(b"partial")
    unrelated = tmp_path / ".model.safetensors.notes"  # not arrayio's: never touched
    unrelated.write_bytes(b"mine")
    assert _atomic.remove_stale_temporaries(tmp_path) == [str(stale)]
    assert not stale.exists() and unrelated.exists()


@pytest.mark.parametrize("name", ["x" * 255, "é" * 121 + ".safetensors"])
def test_a_file_name_at_the_length_limit_can_be_saved(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    arrayio.save(path, {"w": np.arange(3)})
    np.testing.assert_array_equal(arrayio.load(path)["w"], np.arange(3))
    assert temp_files(tmp_path) == []


def test_a_failed_save_names_the_users_path(tmp_path: Path) -> None:
    path = tmp_path / "missing-directory" / "model.safetensors"
    with pytest.raises(FileNotFoundError) as raised:
        arrayio.save(path, NEW)
    assert raised.value.filename == str(path)
    assert TEMP_MARKER not in str(raised.value)


def test_a_full_disk_is_a_disk_full_error_naming_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "model.safetensors"
    arrayio.save(path, OLD)
    old_bytes = path.read_bytes()

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_transfer, "write_many", full)
    with pytest.raises(arrayio.DiskFullError) as raised:
        arrayio.save(path, NEW)
    assert isinstance(raised.value, OSError) and raised.value.errno == errno.ENOSPC
    assert raised.value.filename == str(path)
    assert path.read_bytes() == old_bytes and temp_files(tmp_path) == []


def test_saving_over_a_directory_fails_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    monkeypatch.setattr(_transfer, "write_many", lambda *a, **k: pytest.fail("wrote data"))
    with pytest.raises(IsADirectoryError) as raised:
        arrayio.save(path, NEW)
    assert raised.value.filename == str(path)
    assert temp_files(tmp_path) == []


# --------------------------------------------------------------------------- what is kept


@pytest.mark.parametrize("name", ["model.safetensors", "w.npy"])
@pytest.mark.parametrize("mode", [0o600, 0o640, 0o755])
def test_saving_over_a_file_keeps_its_permissions(tmp_path: Path, name: str, mode: int) -> None:
    path = tmp_path / name
    arrayio.save(path, OLD_NPY if name.endswith(".npy") else OLD)
    path.chmod(mode)
    arrayio.save(path, NEW_NPY if name.endswith(".npy") else NEW)
    assert stat.S_IMODE(path.stat().st_mode) == mode


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may give a file to another owner")
def test_saving_over_a_file_keeps_its_owner(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    arrayio.save(path, OLD)
    os.chown(path, 12345, 12346)
    path.chmod(0o640)
    arrayio.save(path, NEW)
    status = path.stat()
    assert (status.st_uid, status.st_gid, stat.S_IMODE(status.st_mode)) == (12345, 12346, 0o640)


def test_saving_through_a_symlink_writes_its_target(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "step-100.safetensors"
    arrayio.save(target, OLD)
    link = tmp_path / "latest.safetensors"
    link.symlink_to(Path("runs") / "step-100.safetensors")
    arrayio.save(link, NEW)
    assert link.is_symlink() and os.readlink(link) == os.path.join("runs", "step-100.safetensors")
    assert_tree_equal(arrayio.load(target), NEW)
    assert temp_files(tmp_path) == [] and temp_files(tmp_path / "runs") == []


def test_saving_through_a_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "latest.npy"
    link.symlink_to(tmp_path / "new.npy")
    arrayio.save(link, NEW_NPY)
    assert link.is_symlink()
    np.testing.assert_array_equal(np.load(tmp_path / "new.npy"), NEW_NPY)
