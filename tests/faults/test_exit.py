"""A program that queues asynchronous saves and exits at once, without waiting.

Required:

* every queued save completes before the interpreter exits: each file exists and loads
  exactly, the exit code is 0, and the dispatch table written at exit records no tool as
  unavailable (a tool that failed because the interpreter was shutting down is not
  unavailable), for ``ARRAYIO_TOOL`` = ``naive``, ``posix``, ``direct`` and unset;
* a queued save that fails, with nobody left to call ``result()``, is reported on stderr
  at exit, naming the file;
* ``arrayio.wait()`` blocks until every queued asynchronous operation is done.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import arrayio

QUEUED = 40


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["naive", "posix", "direct", None])
def test_exit_with_queued_saves_loses_nothing(
    tmp_path: Path, spawn: Any, child: ModuleType, faults: ModuleType, tool: str | None
) -> None:
    directory = tmp_path / "out"
    directory.mkdir()
    writer = spawn(
        "queue-saves",
        str(directory),
        str(QUEUED),
        env=faults.child_environment(tmp_path, ARRAYIO_TOOL=tool),
    )
    writer.wait_for("queued")
    code = writer.process.wait(240)
    stderr = writer.stderr()

    lost, wrong = [], []
    for index in range(QUEUED):
        path = directory / f"queued{index:03d}.safetensors"
        if not path.exists():
            lost.append(path.name)
            continue
        try:
            loaded = arrayio.load(path)
            faults.assert_arrays_equal(
                loaded, {"x": child.queued_array(index), "index": index}, path.name
            )
        except (AssertionError, arrayio.ArrayioError) as error:
            wrong.append(f"{path.name}: {error}")
    unavailable = [
        f"{table.name}: {entry}"
        for table, data in faults.dispatch_tables(tmp_path / "cache")
        for entry in faults.unavailable_arms(data)
    ]
    left = faults.temporaries(directory)
    summary = (
        f"ARRAYIO_TOOL={tool}: exit code {code}, {len(lost)} of {QUEUED} files lost, "
        f"{len(wrong)} wrong, {len(left)} temporaries left, "
        f"{len(unavailable)} tools marked unavailable"
    )
    print("\n" + summary)
    problems = []
    if code != 0:
        problems.append(f"exit code {code}")
    if lost:
        problems.append(f"lost {lost[:5]}...")
    if wrong:
        problems.append(f"wrong {wrong[:3]}")
    if unavailable:
        problems.append(f"marked unavailable: {unavailable[:3]}")
    if "Traceback" in stderr:
        problems.append(f"stderr has a traceback:\n{stderr[-1500:]}")
    assert not problems, summary + "\n" + "\n".join(problems)


def test_failed_queued_save_is_reported_at_exit(tmp_path: Path, spawn: Any) -> None:
    target = tmp_path / "missing" / "lost.safetensors"  # its directory does not exist
    writer = spawn("queue-failing", str(target))
    writer.wait_for("queued")
    code = writer.process.wait(60)
    stderr = writer.stderr()
    assert str(target) in stderr, (
        f"a queued save that failed went unreported at exit (exit code {code}); stderr: {stderr!r}"
    )


def test_wait_blocks_until_every_queued_operation_is_done(tmp_path: Path) -> None:
    wait = getattr(arrayio, "wait", None)
    assert wait is not None, "arrayio.wait does not exist"
    futures = [
        arrayio.save_async(tmp_path / f"f{i}.safetensors", {"x": np.full(1 << 18, i, np.float32)})
        for i in range(12)
    ]
    futures.append(arrayio.load_async(tmp_path / "f0.safetensors"))
    wait()
    pending = [f.path for f in futures if not f.done()]
    assert not pending, f"arrayio.wait() returned with {len(pending)} operations pending"
    for i in range(12):
        np.testing.assert_array_equal(
            arrayio.load(tmp_path / f"f{i}.safetensors")["x"], np.full(1 << 18, i, np.float32)
        )
