"""Writers killed outright (SIGKILL) at random moments.

A child process saves versions A and B by turns over the same files (``arrayio.save``,
``arrayio.save_async``, Zarr chunk writes through :class:`arrayio.zarr.NVMeStore`) and the
test kills it at a random moment, again and again. After every kill each file must load as
exactly A or exactly B: never torn, never a mix.

A killed process leaves its temporary file behind (``.NAME.arrayio-tmp-*``). The required
behaviour: **the next save into the same directory removes the temporaries of dead
processes** (for Zarr, the next chunk write through a new store), and
``arrayio clean DIR`` removes them under DIR recursively and says how many; the
temporary file of a *live* writer, in another process or in this one, is never removed.

``ARRAYIO_FAULT_KILLS`` sets the kills per kind (default 20; a nightly job may use 500).
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import random
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import arrayio
import arrayio.cli

# A kill lands this long, at most, after the child's first complete save (a save of the
# versions takes about 10 ms on the development VM, so kills land in every phase).
KILL_WINDOW_S = 0.1


def _kills() -> int:
    value = os.environ.get("ARRAYIO_FAULT_KILLS")
    return int(value) if value else 20


# --------------------------------------------------------------------------- checks


def check_saved(
    directory: Path, child: ModuleType, faults: ModuleType, names: list[str]
) -> list[str]:
    """Each container in ``names`` is exactly version A or B (arrays, constants, metadata);
    ``single.npy`` too, if present. Returns the versions found."""
    found = []
    for name in names:
        path = directory / name
        with arrayio.open(path) as reader:
            tag = reader.metadata.get("tag")
            assert tag in ("A", "B"), f"{name}: metadata {reader.metadata!r}"
            loaded = reader.load()
        faults.assert_arrays_equal(loaded, child.version(tag), f"{name} (version {tag})")
        found.append(tag)
    single = directory / "single.npy"
    if single.exists():
        loaded = arrayio.load(single)
        matches = [
            tag
            for tag in "AB"
            if np.array_equal(loaded, child.version_npy(tag)) and loaded.dtype == np.int32
        ]
        assert matches, f"single.npy is neither version: {loaded[:4]}..."
        found.append(matches[0])
    return found


def check_zarr(root: Path, child: ModuleType) -> list[str]:
    """Every chunk of the Zarr array is exactly A's or B's."""
    import zarr

    from arrayio.zarr import NVMeStore

    data = zarr.open_array(NVMeStore(root, read_only=True), mode="r")[...]
    found = []
    for start in range(0, child.ZARR_ELEMENTS, child.ZARR_CHUNK):
        chunk = data[start : start + child.ZARR_CHUNK]
        matches = [
            tag
            for tag in "AB"
            if np.array_equal(chunk, child.zarr_version(tag)[start : start + child.ZARR_CHUNK])
        ]
        assert matches, f"chunk at {start} is neither version: {chunk[:4]}..."
        found.append(matches[0])
    return found


def kill_loop(
    spawn: Any,
    mode: str,
    target: Path,
    check: Any,
    kills: int,
    rng: random.Random,
    faults: ModuleType,
) -> dict[str, Any]:
    """Start ``mode`` on ``target`` and SIGKILL it ``kills`` times at random moments after
    its first complete save, checking the files after every kill."""
    versions: collections.Counter[str] = collections.Counter()
    leftovers = []
    for _ in range(kills):
        writer = spawn(mode, str(target))
        writer.wait_for("saved")
        time.sleep(rng.uniform(0, KILL_WINDOW_S))
        writer.kill()
        versions.update(check())
        leftovers.append(len(faults.temporaries(target)))
    return {
        "kills": kills,
        "versions": dict(versions),
        "temporaries after the last kill": leftovers[-1] if leftovers else 0,
    }


def leave_a_dead_temporary(
    spawn: Any, kind: str, target: Path, faults: ModuleType, directory: Path
) -> None:
    """Kill a writer while it is inside its temporary file: at least one stale temporary
    exists afterwards, however the random kills fell."""
    writer = spawn("die-mid-save", kind, str(target))
    writer.wait_for("blocked")
    writer.kill()
    assert faults.temporaries(directory), "the killed writer left no temporary file"


# --------------------------------------------------------------------------- the loops


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["save", "save_async"])
def test_killed_saves_leave_whole_versions_and_next_save_cleans_up(
    tmp_path: Path, spawn: Any, child: ModuleType, faults: ModuleType, kind: str
) -> None:
    directory = tmp_path / "data"
    directory.mkdir()
    names = ["tree.safetensors"] if kind == "save" else [f"tree{k}.safetensors" for k in range(3)]
    for name in names:
        arrayio.save(directory / name, child.version("A"), metadata={"tag": "A"})
    if kind == "save":
        arrayio.save(directory / "single.npy", child.version_npy("A"))
    mode = "save-loop" if kind == "save" else "async-loop"

    tally = kill_loop(
        spawn,
        mode,
        directory,
        lambda: check_saved(directory, child, faults, names),
        _kills(),
        random.Random(f"kill-{kind}"),
        faults,
    )
    leave_a_dead_temporary(spawn, kind, directory / names[0], faults, directory)
    stale = len(faults.temporaries(directory))
    print(f"\n{kind}: {tally}, {stale} stale temporaries before the next save")

    arrayio.save(directory / "next.safetensors", {"x": np.arange(3)})
    left = faults.temporaries(directory)
    check_saved(directory, child, faults, names)
    assert not left, (
        f"{kind}: the next save into {directory} left {len(left)} of {stale} "
        f"temporaries of killed processes: {[p.name for p in left[:5]]}"
    )


@pytest.mark.slow
def test_killed_zarr_chunk_writes_leave_whole_chunks_and_next_write_cleans_up(
    tmp_path: Path, spawn: Any, child: ModuleType, faults: ModuleType
) -> None:
    import zarr

    from arrayio.zarr import NVMeStore

    root = tmp_path / "array.zarr"
    array = zarr.create_array(
        NVMeStore(root),
        shape=(child.ZARR_ELEMENTS,),
        chunks=(child.ZARR_CHUNK,),
        dtype="float32",
        compressors=None,
    )
    array[...] = child.zarr_version("A")

    tally = kill_loop(
        spawn,
        "zarr-loop",
        root,
        lambda: check_zarr(root, child),
        _kills(),
        random.Random("kill-zarr"),
        faults,
    )
    leave_a_dead_temporary(spawn, "zarr", root, faults, root)
    stale = len(faults.temporaries(root))
    print(f"\nzarr: {tally}, {stale} stale temporaries before the next chunk write")

    fresh = zarr.open_array(NVMeStore(root), mode="r+")
    fresh[: child.ZARR_CHUNK] = child.zarr_version("A")[: child.ZARR_CHUNK]
    left = faults.temporaries(root)
    check_zarr(root, child)
    assert not left, (
        f"zarr: a chunk write through a new NVMeStore left {len(left)} of "
        f"{stale} temporaries of killed processes: "
        f"{[str(p.relative_to(root)) for p in left[:5]]}"
    )


# ------------------------------------------------------------------- live temporaries


@contextlib.contextmanager
def own_save_paused(target: Path) -> Any:
    """Run ``arrayio.save(target, ...)`` in a thread of this process, paused inside its
    temporary file's first write; yields the temporary's path, then lets the save finish."""
    directory = os.path.realpath(target.parent)
    release, paused = threading.Event(), threading.Event()
    where: list[str] = []
    originals = {name: getattr(os, name) for name in ("pwrite", "pwritev", "write")}

    def pausing(name: str) -> Any:
        def write(fd: int, *args: Any) -> Any:
            if threading.current_thread() is not saver or paused.is_set():
                return originals[name](fd, *args)
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = ""
            if ".arrayio-tmp-" in path and path.startswith(directory):
                where.append(path)
                paused.set()
                release.wait(60)
            return originals[name](fd, *args)

        return write

    errors: list[BaseException] = []

    def save() -> None:
        try:
            arrayio.save(target, {"mine": np.arange(1000)})
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(error)

    saver = threading.Thread(target=save)
    for name in originals:
        setattr(os, name, pausing(name))
    try:
        saver.start()
        assert paused.wait(30), "the save never wrote its temporary file"
        yield Path(where[0])
    finally:
        release.set()
        saver.join(60)
        for name, original in originals.items():
            setattr(os, name, original)
    if errors:
        raise errors[0]


def live_writer(spawn: Any, directory: Path) -> tuple[Any, Path]:
    """Another process in the middle of a save into ``directory``, paused inside its
    temporary file until told to go on; returns it and its temporary file."""
    other = spawn("hold-save", str(directory / "theirs.safetensors"), stdin=True)
    line = other.wait_for("holding")
    return other, Path(line.split(" ", 1)[1])


def finish(writer: Any) -> None:
    """Let a :func:`live_writer` go on, and wait until its save is done."""
    assert writer.process.stdin is not None
    writer.process.stdin.write("go\n")
    writer.process.stdin.flush()
    writer.wait_for("finished")


@pytest.mark.slow
def test_next_save_keeps_live_writers_temporaries(
    tmp_path: Path, spawn: Any, child: ModuleType, faults: ModuleType
) -> None:
    directory = tmp_path / "data"
    directory.mkdir()
    leave_a_dead_temporary(spawn, "save", directory / "dead.safetensors", faults, directory)
    dead = faults.temporaries(directory)
    other, theirs = live_writer(spawn, directory)
    with own_save_paused(directory / "mine.safetensors") as mine:
        arrayio.save(directory / "next.safetensors", {"x": np.arange(3)})
        assert theirs.exists(), "the next save removed a live process's temporary file"
        assert mine.exists(), "the next save removed this process's own open temporary file"
        gone = [p for p in dead if not p.exists()]
    finish(other)
    faults.assert_arrays_equal(
        arrayio.load(directory / "theirs.safetensors"), child.version("B"), "theirs"
    )
    np.testing.assert_array_equal(
        arrayio.load(directory / "mine.safetensors")["mine"], np.arange(1000)
    )
    assert gone == dead, (
        f"the next save left {len(dead) - len(gone)} of {len(dead)} temporaries of a killed process"
    )


@pytest.mark.slow
def test_clean_removes_dead_temporaries_recursively(
    tmp_path: Path, spawn: Any, child: ModuleType, faults: ModuleType
) -> None:
    root = tmp_path / "tree"
    (root / "a" / "b").mkdir(parents=True)
    for directory in (root, root / "a" / "b"):
        leave_a_dead_temporary(spawn, "save", directory / "dead.safetensors", faults, directory)
    dead = faults.temporaries(root)
    other, theirs = live_writer(spawn, root / "a")
    out, err = io.StringIO(), io.StringIO()
    # Beside the other live writer: a save cleans its own directory, where no dead one lies.
    with own_save_paused(root / "a" / "mine.safetensors") as mine:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = arrayio.cli.main(["clean", str(root)])
        live = {"theirs": theirs.exists(), "mine": mine.exists()}
    finish(other)
    left = [p for p in dead if p.exists()]
    report = out.getvalue() + err.getvalue()
    assert code == 0, f"arrayio clean {root} exited {code}: {report}"
    assert live == {"theirs": True, "mine": True}, f"live temporaries removed: {live}"
    assert not left, f"arrayio clean left {len(left)} of {len(dead)} dead temporaries"
    assert str(len(dead)) in report, f"the report does not say how many it removed: {report}"
