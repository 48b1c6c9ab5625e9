"""A file truncated (shrunk) by someone else while it is being loaded, for each host tool.

A child process loads a 64 MiB container (four arrays, page cache warm) over and over with
one tool forced (``naive``, ``posix``, ``direct``, ``mmap``) or with the dispatcher's own choice
(``default``: ``ARRAYIO_TOOL`` unset, a fresh dispatch table, settled by 30 loads of an
untouched copy before the truncations begin; ``default-learned-mmap``: the same, with a
table that an older arrayio could have learned, in which mmap is the fastest arm and the
chosen one); the test replaces the file with a fresh copy, waits until the child has loaded
it once, then truncates it inside its data at a random moment. Required, for every tool:
the child never dies by a signal (a memory map touched past the end of a file raises
SIGBUS), and every load either returns exactly the saved data (the truncation came after
it read) or raises ``arrayio.TruncatedFileError``.

``ARRAYIO_FAULT_TRUNCATIONS`` sets the truncations per tool (default 12; nightly: 200).
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import arrayio

TOOLS = ["naive", "posix", "direct", "mmap", "default", "default-learned-mmap"]
WARM_UP_LOADS = 30
# Where a dispatcher had learned that mmap is fastest (the red team's machine, where 7 of
# 24 default loads died), it picked mmap: that state is made by scaling the other arms'
# measurements in the learned table down by this factor, after adding an mmap arm where
# the table has none.
OTHERS_SCALE = 0.2
MMAP_ARM = "mmap(threads=4)"


def _truncations() -> int:
    value = os.environ.get("ARRAYIO_FAULT_TRUNCATIONS")
    return int(value) if value else 12


class Loader:
    """The loading child, restarted after it dies; its deaths are kept."""

    def __init__(self, spawn: Any, path: Path, tool: str, warm_up: Path) -> None:
        self.spawn, self.path, self.tool, self.warm_up = spawn, path, tool, warm_up
        self.child: Any = None
        self.deaths: list[str] = []

    def record(self, timeout: float = 60) -> dict[str, Any] | None:
        """The next load's record, or None if the child died (counted, to be restarted)."""
        if self.child is None:
            # The dispatcher's choice (default) is what it settles on after a few dozen
            # loads of the same file; forced tools need no warm-up.
            loads = WARM_UP_LOADS if self.tool == "default" else 0
            tool = "default" if self.tool.startswith("default") else self.tool
            self.child = self.spawn(
                "load-loop", str(self.path), tool, str(self.warm_up), str(loads)
            )
            self.child.wait_for('{"ready"')
        line = self.child.next_line(timeout)
        if line is None:
            code = self.child.process.wait()
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            stderr = self.child.stderr().strip().splitlines()
            # faulthandler's report: its first line, and where the crashing thread was
            current = next(
                (i for i, line in enumerate(stderr) if line.startswith("Current thread")), 0
            )
            where = next(
                (line.strip() for line in stderr[current:] if line.strip().startswith("File")), ""
            )
            self.deaths.append(f"{how}: {stderr[0] if stderr else ''} {where}")
            self.child = None
            return None
        return json.loads(line)


def teach_mmap(spawn: Any, template: Path, cache: Path, faults: ModuleType) -> str:
    """Let a child's dispatcher learn ``template``'s loads, then edit its table so that
    mmap is the fastest arm of every context it tried, and the chosen one; say what was
    changed."""
    learner = spawn("warm-up", str(template), str(WARM_UP_LOADS))
    learner.wait_for("done")
    assert learner.process.wait(60) == 0, learner.stderr()  # the table is saved at exit
    changed = []
    for path, table in faults.dispatch_tables(cache):
        for key, entry in table.get("contexts", {}).items():
            arms = entry.get("arms", {})
            if not arms:
                continue
            mmap = [label for label in arms if label.startswith("mmap")]
            if not mmap:  # never a candidate here: what an older arrayio would have learned
                best = max(arms.values(), key=lambda arm: arm.get("best_bps", 0))
                arms[MMAP_ARM] = json.loads(json.dumps(best))
                mmap = [MMAP_ARM]
            for label, arm in entry["arms"].items():
                if label != mmap[0]:
                    arm["recent_bps"] = [v * OTHERS_SCALE for v in arm.get("recent_bps", [])]
                    for field in ("best_bps", "last_bps"):
                        arm[field] = arm.get(field, 0) * OTHERS_SCALE
            entry.update(chosen=mmap[0], phase="exploiting", drift=0, held_bps=[])
            changed.append(f"{key}: {mmap[0]}")
        path.write_text(json.dumps(table))
    assert changed, "the dispatcher learned no context of these loads: nothing to teach"
    return "; ".join(changed)


@pytest.mark.slow
@pytest.mark.parametrize("tool", TOOLS)
def test_truncation_during_load(
    tmp_path: Path, spawn: Any, child: ModuleType, faults: ModuleType, tool: str
) -> None:
    template = tmp_path / "template.safetensors"
    arrayio.save(template, child.truncation_data())
    taught = (
        teach_mmap(spawn, template, tmp_path / "cache", faults)
        if tool == "default-learned-mmap"
        else ""
    )
    with arrayio.open(template) as reader:
        data_start = min(info.file_offset for info in reader.arrays.values())
    size = template.stat().st_size
    path = tmp_path / "loaded.safetensors"
    shutil.copyfile(template, path)
    loader = Loader(spawn, path, tool, template)
    rng = random.Random(f"truncate-{tool}")
    outcomes: collections.Counter[str] = collections.Counter()
    failures: list[str] = []

    for _ in range(_truncations()):
        fresh = tmp_path / "fresh.safetensors"
        shutil.copyfile(template, fresh)  # written just now: in the page cache
        with open(fresh, "rb+") as file:
            os.fsync(file.fileno())  # clean pages, as a saved file's are
        os.replace(fresh, path)
        inode = path.stat().st_ino
        seconds = None
        while seconds is None:  # one whole load of the fresh copy: the child is on it
            record = loader.record()
            if record is not None and record["ino"] == inode and record["outcome"] == "ok":
                seconds = record["seconds"]
        time.sleep(rng.uniform(0, 1.5 * seconds))
        cut = time.monotonic()
        os.truncate(path, rng.randrange(data_start, size))
        while True:  # until a load that started after the cut has reported
            record = loader.record()
            if record is None:
                break
            outcomes[record["outcome"]] += 1
            if record["outcome"] not in ("ok", "truncated"):
                failures.append(f"{record['outcome']}: {record.get('detail', '')}")
            if record["start"] > cut:
                if record["outcome"] == "ok" and record["ino"] == inode:
                    failures.append("a load that started after the truncation returned data")
                break

    summary = (
        f"{tool}: {_truncations()} truncations, {len(loader.deaths)} deaths, "
        f"loads {dict(outcomes)}" + (f" (table: {taught})" if taught else "")
    )
    print("\n" + summary)
    assert not (loader.deaths or failures), (
        f"{summary}\nthe loading child died: {loader.deaths[:3]}\n"
        f"loads neither right nor TruncatedFileError: {failures[:5]}"
    )
