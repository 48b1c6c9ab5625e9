"""The candidate arms of every context, pinned: a change to the table must be deliberate.

``candidate_arms.json`` holds, for each combination of direction, memory, cache state, batch
of pieces, checksum, whether the GPU can compute checksums and (for reads not all cached)
whether the bytes are to stay in the page cache, the arms offered at each size
class from 10 to 36: runs of size classes that get the same list (``"10-20 L1, 21-36 L4"``),
the lists named once under ``"lists"``. After a deliberate change to
:mod:`arrayio.dispatch.candidates`, rewrite it with ``python tests/dispatch/test_candidates.py``
and review the diff. The table is pinned as a machine of 16 usable cores gets it
(:data:`PINNED_CORES`); on fewer, page-cache reads into host memory run fewer threads (tested
below).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from arrayio.dispatch import candidates, dispatcher
from arrayio.dispatch.arm import Arm
from arrayio.dispatch.context import Context
from arrayio.integrity import _device_checksum

PINNED = Path(__file__).with_name("candidate_arms.json")
SIZE_CLASSES = range(10, 37)
GRID = [
    cell
    for cell in itertools.product(
        ("read", "write"),
        ("host", "cuda"),
        ("warm", "cold", "mixed", "-"),
        (0, 25),
        (False, True),
        (False, True),
        (False, True),
    )
    if not cell[-1] or (cell[0] == "read" and cell[2] != "warm")  # where keep can be set
]


def _group(
    direction: str,
    memory: str,
    cache: str,
    pieces: int,
    checksum: bool,
    gpu_checksums: bool,
    keep: bool,
) -> str:
    return (
        f"{direction}/{memory}/cache={cache}/pieces={pieces}/checksum={checksum}"
        f"/gpu_checksums={gpu_checksums}" + ("/keep" if keep else "")
    )


PINNED_CORES = 16  # the table as a machine of 16 usable cores gets it, whatever runs the test


def observed(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[list[Any]]]:
    """For each group of the grid, ``[first, last, labels]`` runs over the size classes."""
    monkeypatch.setattr(candidates, "usable_cores", lambda: PINNED_CORES)
    found: dict[str, list[list[Any]]] = {}
    for direction, memory, cache, pieces, checksum, gpu_checksums, keep in GRID:
        monkeypatch.setattr(_device_checksum, "available", lambda on=gpu_checksums: on)
        runs: list[list[Any]] = []
        for size_class in SIZE_CLASSES:
            context = Context(
                direction, memory, size_class, "vda", cache, 1, checksum, pieces, keep
            )
            labels = [arm.label for arm in dispatcher.candidate_arms(context)]
            if runs and runs[-1][2] == labels:
                runs[-1][1] = size_class
            else:
                runs.append([size_class, size_class, labels])
        found[_group(direction, memory, cache, pieces, checksum, gpu_checksums, keep)] = runs
    return found


def pinned() -> dict[str, list[list[Any]]]:
    """:func:`observed` as ``candidate_arms.json`` holds it."""
    data = json.loads(PINNED.read_text())
    return {
        group: [
            [int(first), int(last), data["lists"][name]]
            for run in runs.split(", ")
            for span, name in [run.split(" ")]
            for first, last in [span.split("-")]
        ]
        for group, runs in data["groups"].items()
    }


def _pinned_text(found: dict[str, list[list[Any]]]) -> str:
    names: dict[str, str] = {}
    groups = {}
    for group, runs in found.items():
        parts = []
        for first, last, labels in runs:
            key = json.dumps(labels)
            name = names.setdefault(key, f"L{len(names) + 1}")
            parts.append(f"{first}-{last} {name}")
        groups[group] = ", ".join(parts)
    lists = ",\n".join(f'  "{name}": {key}' for key, name in names.items())
    body = ",\n".join(
        f"  {json.dumps(group)}: {json.dumps(runs)}" for group, runs in groups.items()
    )
    return f'{{\n "lists": {{\n{lists}\n }},\n "groups": {{\n{body}\n }}\n}}\n'


def test_every_context_gets_the_pinned_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = pinned()
    found = observed(monkeypatch)
    changed = sorted(
        group for group in expected.keys() | found.keys() if expected.get(group) != found.get(group)
    )
    assert not changed, (
        f"candidates changed in {len(changed)} groups, first {changed[0]}: "
        f"pinned {expected.get(changed[0])}, now {found.get(changed[0])}"
    )


def test_a_host_context_never_asks_whether_the_gpu_can_checksum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Asking imports CuPy: a host transfer must not pay for it.
    def refuse() -> bool:
        raise AssertionError("host contexts must not look for a GPU")

    monkeypatch.setattr(_device_checksum, "available", refuse)
    for direction, cache, pieces, size_class in itertools.product(
        ("read", "write"), ("warm", "cold", "-"), (0, 25), SIZE_CLASSES
    ):
        dispatcher.candidate_arms(
            Context(direction, "host", size_class, "vda", cache, 1, True, pieces)
        )


def _write_pinned() -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        PINNED.write_text(_pinned_text(observed(monkeypatch)))


if __name__ == "__main__":
    sys.exit(_write_pinned())


def _labels(context: Context) -> list[str]:
    return [arm.label for arm in dispatcher.candidate_arms(context)]


def test_page_cache_reads_into_host_memory_get_no_more_threads_than_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A read from the page cache is a copy on the CPU: on 2 cores, the prior (the first
    # arm) and its rival run 2 threads; reads from the disk keep the threads that wait on it.
    monkeypatch.setattr(candidates, "usable_cores", lambda: 2)
    warm = Context("read", "host", 29, "vda", "warm", 1, True, 0, False)
    assert _labels(warm)[:2] == [
        "posix(task_size=4194304,threads=2)",
        "posix(task_size=8388608,threads=2)",
    ]
    cold = _labels(Context("read", "host", 29, "vda", "cold", 1, True, 0, False))
    assert cold[:3] == [
        "direct(task_size=8388608,threads=4)",
        "direct(task_size=8388608,threads=16)",
        "posix(task_size=4194304,threads=16)",
    ]
    kept = _labels(Context("read", "host", 29, "vda", "cold", 1, True, 0, True))
    assert kept[0] == "posix(task_size=16777216,threads=16)"
    # Writes and GPU reads are not copies out of the page cache: untouched.
    write = _labels(Context("write", "host", 29, "vda", "-", 1, True, 0, False))
    assert "posix(task_size=4194304,threads=16)" in write
    monkeypatch.setattr(candidates, "usable_cores", lambda: 16)
    assert _labels(warm)[0] == "posix(task_size=4194304,threads=16)"


def test_arms_that_meet_once_capped_are_tried_once() -> None:
    arms = (
        Arm.of("posix", threads=16, task_size=4),
        Arm.of("posix", threads=4, task_size=4),
        Arm.of("naive"),
        Arm.of("kvikio", threads=16, task_size=4),
    )
    assert candidates.within_cores(arms, 2) == (
        Arm.of("posix", threads=2, task_size=4),
        Arm.of("naive"),
        Arm.of("kvikio", threads=16, task_size=4),
    )
    assert candidates.within_cores(arms, 32) == arms


def test_usable_cores_are_this_process_s() -> None:
    assert candidates.usable_cores() == len(os.sched_getaffinity(0))
