"""What the fault tests run in child processes: ``python _child.py MODE ARGS...``.

Each mode reports on stdout, one line per event, flushed, so that the parent can time its
faults (a SIGKILL, a truncation) against the child's progress. The data the children write
are defined here (:func:`version`, :func:`queued_array`) and the tests load this file to
compare what they find against them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

TEMP_MARKER = ".arrayio-tmp-"
# Sizes for the kill loops: big enough that a save takes a few milliseconds (so that kills
# land inside saves), small enough that a child does many saves between kills.
KILL_ELEMENTS = 1 << 20  # 4 MiB of float32 per array
ZARR_ELEMENTS, ZARR_CHUNK = 1 << 20, 1 << 18  # four chunks of 1 MiB


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def version(tag: str) -> dict[str, Any]:
    """Version ``"A"`` or ``"B"`` of the pytree the kill loops save: same keys and shapes,
    every value different, so that any mix of the two is told apart."""
    sign = 1.0 if tag == "A" else -1.0
    return {
        "w": np.arange(KILL_ELEMENTS, dtype=np.float32) * sign,
        "b": np.full((3, 5), sign, np.float64),
        "tag": tag,
        "step": 1 if tag == "A" else 2,
    }


def version_npy(tag: str) -> np.ndarray:
    return np.arange(KILL_ELEMENTS // 2, dtype=np.int32) * (1 if tag == "A" else -1)


def zarr_version(tag: str) -> np.ndarray:
    return np.arange(ZARR_ELEMENTS, dtype=np.float32) * (1.0 if tag == "A" else -1.0)


def queued_array(index: int) -> np.ndarray:
    """The array of the ``index``-th queued save: 4 to 8 MiB (more than one task of the
    threaded tools, whose pools the exiting interpreter stops), values tied to ``index``."""
    nbytes = (4 << 20) + 4096 + (index * 7_340_033) % (4 << 20)
    return (np.arange(nbytes // 4, dtype=np.uint32) * 2654435761 + index).astype(np.uint32)


def _block_writes_to_temporaries(directory: str) -> None:
    """From now on, writing to an arrayio temporary file under ``directory`` announces
    ``blocked`` and sleeps until the process is killed: a process that dies in the middle
    of writing a temporary file, whatever path inside arrayio the write takes."""
    directory = os.path.realpath(directory)

    def blocking(original: Any) -> Any:
        def write(fd: int, *args: Any) -> Any:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                target = ""
            if TEMP_MARKER in target and target.startswith(directory):
                say("blocked", target)
                while True:
                    time.sleep(60)
            return original(fd, *args)

        return write

    for name in ("pwrite", "pwritev", "write"):
        setattr(os, name, blocking(getattr(os, name)))


# --------------------------------------------------------------------------- modes


def save_loop(directory: str) -> None:
    """Save A and B by turns over a container and a ``.npy`` until killed."""
    import arrayio

    container = os.path.join(directory, "tree.safetensors")
    single = os.path.join(directory, "single.npy")
    for i in range(10**9):
        tag = "AB"[i % 2]
        arrayio.save(container, version(tag), metadata={"tag": tag})
        arrayio.save(single, version_npy(tag))
        say("saved", i, time.monotonic())


def async_loop(directory: str) -> None:
    """Queue A and B by turns on three containers at once until killed."""
    import arrayio

    paths = [os.path.join(directory, f"tree{k}.safetensors") for k in range(3)]
    for i in range(10**9):
        tag = "AB"[i % 2]
        futures = [arrayio.save_async(path, version(tag), metadata={"tag": tag}) for path in paths]
        futures.append(
            arrayio.save_async(
                paths[0], version("AB"[(i + 1) % 2]), metadata={"tag": "AB"[(i + 1) % 2]}
            )
        )
        for future in futures:
            future.result()
        say("saved", i, time.monotonic())


def zarr_loop(root: str) -> None:
    """Write A and B by turns over a Zarr array's chunks until killed."""
    import zarr

    from arrayio.zarr import NVMeStore

    array = zarr.open_array(NVMeStore(root), mode="r+")
    for i in range(10**9):
        array[...] = zarr_version("AB"[i % 2])
        say("saved", i, time.monotonic())


def die_mid_save(kind: str, target: str) -> None:
    """Start one save of ``kind`` (``save``, ``save_async`` or ``zarr``) into ``target``
    and block inside its temporary file's writes (the parent kills or releases us)."""
    import arrayio

    directory = target if kind == "zarr" else os.path.dirname(target)
    _block_writes_to_temporaries(directory)
    if kind == "save":
        arrayio.save(target, version("B"), metadata={"tag": "B"})
    elif kind == "save_async":
        arrayio.save_async(target, version("B"), metadata={"tag": "B"}).result()
    else:
        import zarr

        from arrayio.zarr import NVMeStore

        zarr.open_array(NVMeStore(target), mode="r+")[...] = zarr_version("B")
    say("finished")


def hold_save(target: str) -> None:
    """Save ``version("B")`` to ``target``, pausing inside the temporary file's first write
    until a line arrives on stdin: a live writer whose temporary file must survive."""
    import arrayio

    directory = os.path.realpath(os.path.dirname(target))
    original = {name: getattr(os, name) for name in ("pwrite", "pwritev", "write")}
    paused = []

    def pausing(name: str) -> Any:
        def write(fd: int, *args: Any) -> Any:
            try:
                where = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                where = ""
            if not paused and TEMP_MARKER in where and where.startswith(directory):
                paused.append(where)
                say("holding", where)
                sys.stdin.readline()
            return original[name](fd, *args)

        return write

    for name in original:
        setattr(os, name, pausing(name))
    arrayio.save(target, version("B"), metadata={"tag": "B"})
    say("finished")


def load_loop(path: str, tool: str, warm_up: str = "", loads: str = "0") -> None:
    """Load ``path`` over and over; report each load as one JSON line: when it started,
    the file's inode, and ``ok`` (data as expected), ``wrong`` (data not as expected), ``truncated``
    (TruncatedFileError) or ``error`` (anything else, with its type and message). First
    ``loads`` loads of ``warm_up``, a copy that is never truncated."""
    import arrayio

    expected = truncation_data()
    chosen = None if tool == "default" else tool
    for _ in range(int(loads)):  # the dispatcher settles on its steady choice first
        arrayio.load(warm_up, tool=chosen)
    say(json.dumps({"ready": True}))
    while True:
        start = time.monotonic()  # CLOCK_MONOTONIC: the parent's clock too (Linux)
        record: dict[str, Any] = {"ino": None, "start": start}
        try:
            with arrayio.open(path, tool=chosen) as reader:
                record["ino"] = os.fstat(reader.fd).st_ino
                loaded = reader.load()
            same = loaded.keys() == expected.keys() and all(
                np.array_equal(loaded[k], v) for k, v in expected.items()
            )
            record["outcome"] = "ok" if same else "wrong"
        except arrayio.TruncatedFileError as error:
            record.update(outcome="truncated", detail=str(error)[:200])
        except Exception as error:  # noqa: BLE001 - reported to the parent, which fails
            record.update(outcome="error", detail=f"{type(error).__name__}: {error}"[:300])
        record["seconds"] = time.monotonic() - start
        say(json.dumps(record))


def warm_up(path: str, loads: str) -> None:
    """Load ``path`` ``loads`` times with the dispatcher's choice, then exit (saving what the
    dispatcher learned, at exit)."""
    import arrayio

    for _ in range(int(loads)):
        arrayio.load(path)
    say("done")


def truncation_data() -> dict[str, np.ndarray]:
    """The file the truncation tests load: 64 MiB in four arrays."""
    return {f"part{k}": np.arange(k << 22, (k + 1) << 22, dtype=np.uint32) for k in range(4)}


def queue_saves(directory: str, count: str) -> None:
    """Queue ``count`` saves of :func:`queued_array` and exit at once, without waiting.
    The arrays are made first, so that the saves are queued faster than they are written
    and most of them are still queued when the interpreter exits."""
    import arrayio

    arrays = [queued_array(index) for index in range(int(count))]
    for index, array in enumerate(arrays):
        arrayio.save_async(
            os.path.join(directory, f"queued{index:03d}.safetensors"), {"x": array, "index": index}
        )
    say("queued")


def queue_failing(target: str) -> None:
    """Queue a save that will fail (its directory does not exist) and exit at once."""
    import arrayio

    arrayio.save_async(target, {"x": np.ones(1000, np.float32)})
    say("queued")


MODES = {
    "save-loop": save_loop,
    "async-loop": async_loop,
    "zarr-loop": zarr_loop,
    "die-mid-save": die_mid_save,
    "hold-save": hold_save,
    "load-loop": load_loop,
    "warm-up": warm_up,
    "queue-saves": queue_saves,
    "queue-failing": queue_failing,
}

if __name__ == "__main__":
    MODES[sys.argv[1]](*sys.argv[2:])
