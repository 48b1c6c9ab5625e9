"""A quick bandwidth sweep on this machine: every registered transfer tool that can run here,
and the dispatcher, at a few sizes; behind ``arrayio bench`` and the dispatcher notebook.

>>> result = run("/mnt/nvme/scratch", sizes=[1 << 20, 64 << 20])   # doctest: +SKIP
>>> print(result.table())                                         # doctest: +SKIP
>>> result.plot().savefig("bench.png")                            # doctest: +SKIP

Each tool runs with its default parameters; the dispatcher runs as every load and save does,
timed once it has finished exploring. Every write is timed until its bytes are on the device.
Figures are medians of ``repeats`` samples, in GB/s (10^9 bytes per second). A quick look, not
the benchmark harness (``benchmarks/sweep.py``); docs/design/cli.md says how it measures.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import tools
from ..arrays import _dtypes
from ..arrays._buffers import aligned_empty
from ..dispatch import _transfer, second_pass
from ..dispatch import dispatcher as dispatch
from ..integrity._checksum import ChecksumParts
from ..runtime import _progress
from ..runtime._units import format_bytes
from ..tools._io import flush_range

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["DEFAULT_SIZES", "BenchResult", "BenchRow", "run"]

DEFAULT_SIZES = (256 << 10, 4 << 20, 64 << 20)
DISPATCHER = "dispatcher"
_SAMPLE_BYTES = 8 << 20  # small transfers repeat within a sample to be timed reliably
_MAX_LEARNING_CALLS = 64


@dataclasses.dataclass(frozen=True, slots=True)
class BenchRow:
    """One measurement: an arm (a tool with its default parameters, or the dispatcher) in
    one case. ``gbps`` is None when the arm failed here (``error`` says why); ``chosen``
    is, for the dispatcher, the arm it used."""

    arm: str
    direction: str
    cache: str
    memory: str
    nbytes: int
    gbps: float | None
    error: str | None = None
    chosen: str | None = None

    @property
    def panel(self) -> tuple[str, str, str]:
        return (self.direction, self.cache, self.memory)


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """What :func:`run` measured: ``str()`` or :meth:`table` for text, :meth:`plot` for a
    figure, :meth:`as_dict` for JSON."""

    rows: tuple[BenchRow, ...]
    directory: str
    checksum: bool
    repeats: int
    skipped: dict[str, str]  # tool name -> why it was not measured

    def panels(self) -> list[tuple[str, str, str]]:
        """The (direction, cache, memory) cases, in the order measured."""
        return list(dict.fromkeys(row.panel for row in self.rows))

    def sizes(self) -> list[int]:
        return sorted({row.nbytes for row in self.rows})

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return {
            "directory": self.directory,
            "checksum": self.checksum,
            "repeats": self.repeats,
            "skipped": dict(self.skipped),
            "rows": [dataclasses.asdict(row) for row in self.rows],
        }

    def table(self) -> str:
        """One text table per case: arms down, sizes across, GB/s in the cells."""
        sizes = self.sizes()
        lines: list[str] = []
        for panel in self.panels():
            rows = [row for row in self.rows if row.panel == panel]
            arms = list(dict.fromkeys(row.arm for row in rows))
            cell = {(row.arm, row.nbytes): row for row in rows}
            width = max(len(arm) for arm in arms)
            direction, cache, memory = panel
            title = f"{direction}{' ' + cache if cache != '-' else ''}, {memory} memory"
            if direction == "write":
                title += ", flushed to the device"
            lines.append(f"{title} (GB/s, checksums {'on' if self.checksum else 'off'})")
            lines.append(" " * width + "".join(f"{format_bytes(n):>11}" for n in sizes))
            for arm in arms:
                figures = []
                for nbytes in sizes:
                    row = cell.get((arm, nbytes))
                    figures.append(
                        "" if row is None else "failed" if row.gbps is None else f"{row.gbps:.2f}"
                    )
                lines.append(f"{arm:<{width}}" + "".join(f"{f:>11}" for f in figures))
            used = [
                f"{format_bytes(row.nbytes)}: {row.chosen}"
                for row in rows
                if row.arm == DISPATCHER and row.chosen
            ]
            if used:
                lines.append("dispatcher used: " + "; ".join(used))
            failures = {row.arm: row.error for row in rows if row.error}
            lines.extend(f"{arm} failed: {error}" for arm, error in failures.items())
            lines.append("")
        lines.extend(f"not measured: {name} ({reason})" for name, reason in self.skipped.items())
        return "\n".join(lines).rstrip()

    def __str__(self) -> str:
        return self.table()

    def plot(self, figure: Figure | None = None) -> Figure:
        """Bandwidth against size, one line per arm, one panel per case (matplotlib).

        Parameters
        ----------
        figure
            Draw into this figure (e.g. ``plt.figure()`` in a notebook); default: a new
            ``matplotlib.figure.Figure``, which needs no display (``.savefig(path)``).

        Raises
        ------
        FrameworkNotAvailableError
            If matplotlib is not installed.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError:
            from ..errors import FrameworkNotAvailableError

            raise FrameworkNotAvailableError(
                "plots need matplotlib: pip install 'arrayio[bench]'"
            ) from None
        panels = self.panels()
        if figure is None:
            figure = Figure(figsize=(5 * max(1, len(panels)), 4), layout="constrained")
        axes = figure.subplots(1, max(1, len(panels)), squeeze=False)[0]
        for ax, panel in zip(axes, panels, strict=False):
            rows = [row for row in self.rows if row.panel == panel and row.gbps is not None]
            for arm in dict.fromkeys(row.arm for row in rows):
                points = sorted((row.nbytes, row.gbps) for row in rows if row.arm == arm)
                style = (
                    {"color": "black", "linewidth": 2.5, "linestyle": "--", "zorder": 3}
                    if arm == DISPATCHER
                    else {"alpha": 0.85}
                )
                ax.plot(
                    [p[0] for p in points], [p[1] for p in points], marker="o", label=arm, **style
                )
            direction, cache, memory = panel
            ax.set_title(f"{direction}{' ' + cache if cache != '-' else ''}, {memory}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(self.sizes(), [format_bytes(n) for n in self.sizes()])
            ax.set_xlabel("transfer size")
            ax.set_ylabel("GB/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
        figure.suptitle(
            f"arrayio bench: {self.directory} (checksums "
            f"{'on' if self.checksum else 'off'}, median of {self.repeats})"
        )
        return figure


def _host_buffer(nbytes: int) -> np.ndarray:
    buffer = aligned_empty(nbytes)
    buffer[:] = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    return buffer


def _device_buffer(nbytes: int, device: str) -> Any:
    from ..arrays._frameworks import allocate, parse_target

    return allocate(parse_target("cupy", device), _dtypes.by_name("uint8"), (nbytes,)).data


class _Case:
    """The files and buffer of one (memory, size): ``time(call)`` gives median seconds."""

    def __init__(
        self,
        data_path: str,
        write_path: str,
        buffer: Any,
        nbytes: int,
        cache: str,
        direction: str,
        repeats: int,
    ) -> None:
        self.data_path, self.write_path = data_path, write_path
        self.buffer, self.nbytes = buffer, nbytes
        self.cache, self.direction, self.repeats = cache, direction, repeats
        self.calls = max(1, min(64, math.ceil(_SAMPLE_BYTES / nbytes)))

    def open(self) -> int:
        if self.direction == "read":
            return os.open(self.data_path, os.O_RDONLY)
        return os.open(self.write_path, os.O_WRONLY | os.O_CREAT, 0o600)

    def prepare(self, fd: int) -> None:
        if self.direction == "read" and self.cache == "cold":
            second_pass.evict(fd)

    def time(self, call: Callable[[int], None]) -> float:
        """Median seconds of one ``call(fd)`` over the repeats (one untimed call first)."""
        fd = self.open()
        try:
            call(fd)  # tool setup (threads, buffers) and, for warm reads, the page cache
            seconds = []
            for _ in range(self.repeats):
                elapsed = 0.0
                for _ in range(self.calls):
                    self.prepare(fd)
                    start = time.perf_counter()
                    call(fd)
                    elapsed += time.perf_counter() - start
                seconds.append(elapsed / self.calls)
            return statistics.median(seconds)
        finally:
            os.close(fd)


def _tool_call(tool: tools.Tool, case: _Case, checksum: bool) -> Callable[[int], None]:
    def call(fd: int) -> None:
        parts = ChecksumParts(case.nbytes) if checksum else None
        if case.direction == "read":
            got = tool.read(fd, case.buffer, 0, checksum=parts)
            if got != case.nbytes:
                raise OSError(f"read {got} of {case.nbytes} bytes")
        else:
            tool.write(fd, case.buffer, 0, checksum=parts)
            flush_range(fd, 0, case.nbytes)  # every write arm is timed to the device
        if parts is not None:
            parts.value()

    return call


def _dispatcher_call(case: _Case, checksum: bool) -> Callable[[int], None]:
    def call(fd: int) -> None:
        if case.direction == "read":
            _transfer.read_into(fd, 0, case.buffer, path=case.data_path, with_checksum=checksum)
        else:
            _transfer.write_from(fd, 0, case.buffer, with_checksum=checksum)
            # As for the tools: below 1 MiB the dispatcher's own path leaves the bytes in the
            # page cache (a save's final fsync writes them); above, this finds nothing left.
            flush_range(fd, 0, case.nbytes)

    return call


def _learn(case: _Case, call: Callable[[int], None]) -> None:
    """Run the dispatcher until it exploits in this case's context (or is never to learn)."""
    active = dispatch.get()
    fd = case.open()
    try:
        for _ in range(_MAX_LEARNING_CALLS):
            case.prepare(fd)
            call(fd)
            context = active.last[0] if active.last is not None else None
            if context is None or active.policy.explain(context).phase != "exploring":
                return
    finally:
        os.close(fd)


def _candidates(
    memory: str, direction: str, checksum: bool, only: Iterable[str] | None, skipped: dict[str, str]
) -> list[str]:
    names = []
    for name in tools.names() if only is None else only:
        try:
            cls = tools.tool_class(name)
            availability = cls.availability()
        except ImportError as error:
            skipped[name] = f"cannot import: {error}"
            continue
        if not availability:
            skipped[name] = availability.reason
        elif not cls.capabilities.serves(direction, memory):
            continue  # e.g. mmap writes, staged into host memory: not what the tool is for
        elif checksum and not cls.capabilities.checksums:
            skipped[name] = "cannot checksum (measure with checksum=False)"
        else:
            names.append(name)
    return names


def run(
    directory: str | os.PathLike[str] = ".",
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    memory: Sequence[str] = ("host",),
    directions: Sequence[str] = ("read", "write"),
    caches: Sequence[str] = ("warm",),
    tool_names: Iterable[str] | None = None,
    dispatcher: bool = True,
    checksum: bool = True,
    repeats: int = 3,
    device: str = "cuda:0",
    progress: bool | None = None,
) -> BenchResult:
    """Measure every available transfer tool and the dispatcher on a scratch file.

    Parameters
    ----------
    directory
        Where the scratch files go (a directory on the storage to measure); they are
        removed afterwards.
    sizes
        Transfer sizes in bytes.
    memory
        ``"host"`` and/or ``"cuda"`` (GPU memory, through CuPy, on ``device``).
    directions
        ``"read"`` and/or ``"write"``.
    caches
        For reads: ``"warm"`` (in the page cache) and/or ``"cold"`` (evicted first).
    tool_names
        Registered tool names to measure (default: all that can run here).
    dispatcher
        Also measure the dispatcher (after it has learned each case).
    checksum
        Compute CRC-32C on the way, as arrayio's loads and saves do (default). Tools that
        cannot are then not measured.
    repeats
        Samples per measurement; the median is reported.
    device
        The GPU for ``memory="cuda"``.
    progress
        A progress bar over the cases (see :func:`arrayio.save`).

    Returns
    -------
    BenchResult

    Raises
    ------
    ValueError
        For empty or non-positive sizes, unknown memory kinds, directions or caches.
    """
    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"sizes must be positive byte counts, got {sizes}")
    for name, given, known in (
        ("memory", memory, {"host", "cuda"}),
        ("directions", directions, {"read", "write"}),
        ("caches", caches, {"warm", "cold"}),
    ):
        if not given or not set(given) <= known:
            raise ValueError(f"{name} must be among {sorted(known)}, got {list(given)}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    skipped: dict[str, str] = {}
    plan = []
    for kind in memory:
        for direction in directions:
            names = _candidates(kind, direction, checksum, tool_names, skipped)
            arms = names + ([DISPATCHER] if dispatcher else [])
            for cache in caches if direction == "read" else ("-",):
                plan.extend(
                    (kind, direction, cache, nbytes, arm) for nbytes in sizes for arm in arms
                )

    scratch = tempfile.mkdtemp(prefix=".arrayio-bench-", dir=directory)
    data_path, write_path = os.path.join(scratch, "data"), os.path.join(scratch, "write")
    rows: list[BenchRow] = []
    made: dict[str, tools.Tool] = {}
    try:
        pattern = _host_buffer(min(sizes[-1], 64 << 20))
        with open(data_path, "wb") as f:
            for start in range(0, sizes[-1], pattern.nbytes):
                f.write(pattern[: min(pattern.nbytes, sizes[-1] - start)])
            os.fsync(f.fileno())
        buffers: dict[tuple[str, int], Any] = {}
        with _progress.bar(
            len(plan), desc="arrayio bench", unit="case", progress=progress
        ) as advance:
            for kind, direction, cache, nbytes, arm in plan:
                if (kind, nbytes) not in buffers:
                    buffers = {
                        (kind, nbytes): _host_buffer(nbytes)
                        if kind == "host"
                        else _device_buffer(nbytes, device)
                    }
                case = _Case(
                    data_path, write_path, buffers[kind, nbytes], nbytes, cache, direction, repeats
                )
                rows.append(_measure(arm, case, kind, checksum, made))
                advance(1)
    finally:
        for tool in made.values():
            tool.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return BenchResult(tuple(rows), os.path.abspath(directory), checksum, repeats, skipped)


def _measure(
    arm: str, case: _Case, memory: str, checksum: bool, made: dict[str, tools.Tool]
) -> BenchRow:
    chosen = None
    try:
        if arm == DISPATCHER:
            call = _dispatcher_call(case, checksum)
            _learn(case, call)
            seconds = case.time(call)
            last = dispatch.get().last
            chosen = last[1].label if last is not None else None
        else:
            if arm not in made:
                made[arm] = tools.make(arm)
            seconds = case.time(_tool_call(made[arm], case, checksum))
        label = arm if arm == DISPATCHER else made[arm].label
        return BenchRow(
            label,
            case.direction,
            case.cache,
            memory,
            case.nbytes,
            case.nbytes / seconds / 1e9,
            chosen=chosen,
        )
    except Exception as error:  # noqa: BLE001 - a tool refused here (O_DIRECT on tmpfs...) is
        # reported in its row and the sweep goes on
        label = made[arm].label if arm in made else arm
        return BenchRow(
            label,
            case.direction,
            case.cache,
            memory,
            case.nbytes,
            None,
            error=f"{type(error).__name__}: {error}",
        )
