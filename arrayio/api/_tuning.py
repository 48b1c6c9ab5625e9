"""``arrayio.tune`` builds the dispatcher's table ahead of time; ``arrayio.explain`` shows it.

Both work on the process-wide dispatcher (:mod:`arrayio.dispatch.dispatcher`), whose table is
saved under ``ARRAYIO_CACHE_DIR`` and reloaded by the next process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from .. import config, tools
from ..arrays import _dtypes
from ..arrays._frameworks import allocate, parse_target
from ..dispatch import dispatcher as dispatch
from ..dispatch import second_pass
from ..dispatch.context import Context, cache_state
from ..dispatch.policy import Explanation
from ..errors import KeyNotFoundError
from ..runtime import _stages
from ..runtime._units import format_count, parse_size

__all__ = ["DispatchReport", "explain", "tune"]

_DEFAULT_SIZES = (64 << 10, 1 << 20, 16 << 20, 256 << 20)  # smaller ones are not learned


@dataclasses.dataclass(frozen=True)
class DispatchReport:
    """What the dispatcher chose (or would choose) per context, why, and what it measured.

    ``str()`` gives a text table; Jupyter shows an HTML one. ``tools`` maps each registered
    tool to ``None`` when it can run here, or to the reason it cannot.
    """

    explanations: tuple[Explanation, ...]
    tools: dict[str, str | None]
    table_path: str | None
    # The process's last load: its seconds and where they went (arrayio.runtime._stages).
    last_load: dict[str, Any] | None = None
    # The tools the dispatcher set up in the background in this process (Policy.set_ups).
    set_ups: tuple[dict[str, Any], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "table_path": self.table_path,
            "tools": dict(self.tools),
            "contexts": [e.as_dict() for e in self.explanations],
            "last_load": self.last_load,
            "set_ups": [dict(record) for record in self.set_ups],
        }

    def __str__(self) -> str:
        lines = [f"arrayio dispatch table: {self.table_path or '(in memory only)'}"]
        for name, reason in self.tools.items():
            lines.append(f"  tool {name:8s} {'available' if reason is None else reason}")
        if self.last_load is not None:
            lines.append(f"  last load: {stages_text(self.last_load)}")
        for record in self.set_ups:
            lines.append(f"  set up in the background: {set_up_text(record)}")
        if not self.explanations:
            lines.append("  nothing learned yet: transfers (or arrayio.tune) teach it")
        for explanation in self.explanations:
            lines.append("")
            lines.append(f"{explanation.key}: {explanation.chosen or '-'}  [{explanation.reason}]")
            if explanation.rule is not None:
                lines.append(f"    page cache: {explanation.rule}")
            for arm in explanation.arms:
                figure = f"{arm.gbps:8.2f} GB/s" if arm.gbps is not None else " " * 13
                extra = (
                    f" ({format_count(arm.samples, 'sample')}, {format_count(arm.count, 'call')})"
                    if arm.count
                    else ""
                )
                reason = f"  {arm.reason}" if arm.reason else ""
                lines.append(f"    {arm.label:44s} {arm.state:12s}{figure}{extra}{reason}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        from ._html import dispatch_report_html

        return dispatch_report_html(self)


def _tool_availability() -> dict[str, str | None]:
    report: dict[str, str | None] = {}
    for name in tools.names():
        try:
            availability = tools.tool_class(name).availability()
        except ImportError as error:
            report[name] = f"cannot import: {error}"
            continue
        report[name] = None if availability else availability.reason
    return report


def _context_of(attributes: dict[str, Any]) -> Context | None:
    try:
        return Context(**attributes)
    except TypeError:
        return None


def explain(
    path: str | os.PathLike[str] | None = None,
    *,
    key: str | None = None,
    device: Any = None,
    verify: bool | None = None,
) -> DispatchReport:
    """Show what the dispatcher learned, or what it would do for reading a file.

    Parameters
    ----------
    path
        A file arrayio can open. Without it, every learned context is shown.
    key
        With ``path``: only this array (default: every array of the file, which a load
        moves as one batch: one context, of their total size and typical array; a load
        whose results are copies, as JAX's ``device_put`` of host bytes without CuPy, reads
        in batches of up to 1 GiB instead, each in the context of its own size).
    device
        With ``path``: where the arrays would be read to (default: the CPU).
    verify
        With ``path``: whether the read would verify checksums (default: the setting).

    Returns
    -------
    DispatchReport
        Per context: the chosen arm and why, each arm's measured bandwidth, and the arms
        marked unavailable (the fallbacks) with the error that caused it.
    """
    active = dispatch.get()
    explanations: list[Explanation] = []
    if path is None:
        for _, entry in active.table.items():
            context = _context_of(entry.attributes)
            if context is not None:
                explanations.append(active.policy.explain(context))
    else:
        from ._reader import Reader

        memory = "cuda" if parse_target(None, device).placement.is_cuda else "host"
        check = config.get().verify_checksums if verify is None else verify
        with Reader(path) as reader:
            keys = [key] if key is not None else reader.keys()
            for name in keys:
                if name not in reader:
                    raise KeyNotFoundError(f"{reader.path}: no array {name!r}")
            every = [reader[name] for name in keys]
            # What load() does: the arrays it learns for (1 MiB and more, or all of them
            # under a forced tool) move as one batch, in the batch's context.
            forced = active.forced_arm(None)
            infos = [
                info
                for info in every
                if info.nbytes and (forced is not None or info.nbytes >= dispatch.SMALL_TRANSFER)
            ]
            if infos:  # verified if any array of the load is (as Reader._read_batch does)
                checksum = check and any(info.crc32c is not None for info in every)
                context = active.batch_context(
                    "read",
                    reader.fd,
                    [(info.file_offset, info.nbytes) for info in infos],
                    memory,
                    checksum,
                )
                explanations.append(active.policy.explain(context, force=forced))
    return DispatchReport(
        tuple(explanations),
        _tool_availability(),
        active.table_path,
        _stages.last(),
        tuple(active.policy.set_ups()),
    )


def set_up_text(record: dict[str, Any]) -> str:
    """One line for a background set-up (see ``Policy.set_ups``): the arm, whom for, how
    long it took and its steps, or that it is still running, or how it failed."""
    text = f"{record['arm']} (for the {record['for']}): "
    if record["seconds"] is None:
        return text + "running"
    steps = ", ".join(f"{step} {1e3 * s:.1f} ms" for step, s in record["steps"].items())
    text += f"{1e3 * record['seconds']:.1f} ms" + (f" ({steps})" if steps else "")
    return text + (f"; failed: {record['error']}" if "error" in record else "")


def stages_text(record: dict[str, Any]) -> str:
    """A recorded call's seconds, then each stage's (see :mod:`arrayio.runtime._stages`):
    ``"<total>: open <seconds>, allocate <seconds>, transfers <seconds>, ..."``, in
    milliseconds below a tenth of a second."""

    def seconds(value: float) -> str:
        return f"{value:.3f} s" if value >= 0.1 else f"{value * 1e3:.1f} ms"

    parts = ", ".join(f"{name} {seconds(value)}" for name, value in record["stages"].items())
    total = seconds(record["seconds"]) if record["seconds"] is not None else "?"
    return f"{total}: {parts}" if parts else total


def tune(
    directory: str | os.PathLike[str] = ".",
    *,
    device: Any = None,
    sizes: Iterable[int] = _DEFAULT_SIZES,
    directions: Sequence[str] = ("read", "write"),
    caches: Sequence[str] = ("warm", "cold"),
    verify: bool | None = None,
    max_calls: int = 400,
    arrays: Any = None,
) -> DispatchReport:
    """Teach the dispatcher this machine ahead of time, on a scratch file in ``directory``.

    For every size, direction and (for reads) cache state, transfers run through the
    dispatcher until it stops exploring; the table is then saved, so later processes start
    from it. Cold reads evict the file's pages first (``posix_fadvise``; no root needed).
    With ``arrays``, saves and loads of them run the same way.

    Parameters
    ----------
    directory
        A directory on the storage to tune for (the scratch file is removed afterwards).
    device
        ``"cpu"`` (default) or a GPU (``"cuda:0"``...): where the bytes go.
    sizes
        Transfer sizes: byte counts, or strings as ``"64K"``, ``"1M"``, ``"1GiB"``.
    directions
        ``"read"`` and/or ``"write"``.
    caches
        ``"warm"`` and/or ``"cold"``, for reads.
    verify
        Tune for checksummed transfers (the default, as loads verify by default) or not.
    max_calls
        At most this many calls per context.
    arrays
        What you save and load (a checkpoint's state: anything :func:`arrayio.save`
        takes). A save or a load moves its arrays as one batch, learned in a context of its
        own (its total size and its typical array), not that of one transfer of a size in
        ``sizes``: ``arrays`` tunes it by saving them and loading them to ``device``, cold
        and warm. Give ``sizes=()`` to tune for them alone. Every call moves all of them
        (tuning for a checkpoint of several gigabytes takes minutes); a lower
        ``max_calls`` bounds that, leaving the rest to be learned in real use.

    Returns
    -------
    DispatchReport
        The tuned contexts.
    """
    active = dispatch.get()
    sizes = sorted({parse_size(s) if isinstance(s, str) else int(s) for s in sizes})
    if (not sizes and arrays is None) or (sizes and sizes[0] <= 0):
        raise ValueError(f"sizes must be positive byte counts, got {sizes}")
    check = config.get().verify_checksums if verify is None else verify
    tuned: dict[str, Context] = {}
    # Tuning learns what the dispatcher would choose, one whole call per arm: quick to
    # converge, and its calls are its own, not a user's to slow down.
    # Its scratch files say nothing of what a program reads again (dispatch.rereads).
    with config.set(tool=None), active.policy.whole_calls(), active.rereads.untracked():
        if sizes:
            _tune_sizes(
                active, directory, device, sizes, directions, caches, check, max_calls, tuned
            )
        if arrays is not None:
            _tune_arrays(
                active, directory, device, arrays, directions, caches, check, max_calls, tuned
            )
    active.save()
    return DispatchReport(
        tuple(active.policy.explain(c) for c in tuned.values()),
        _tool_availability(),
        active.table_path,
    )


def _tune_sizes(
    active: dispatch.Dispatcher,
    directory: str | os.PathLike[str],
    device: Any,
    sizes: list[int],
    directions: Sequence[str],
    caches: Sequence[str],
    check: bool,
    max_calls: int,
    tuned: dict[str, Context],
) -> None:
    request = parse_target("cupy" if _is_gpu(device) else None, device)
    uint8 = _dtypes.by_name("uint8")
    fd_data, data_path = tempfile.mkstemp(prefix=".arrayio-tune-", dir=directory)
    write_path = data_path + ".w"
    try:
        pattern = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
        for start in range(0, sizes[-1], pattern.nbytes):
            os.pwrite(fd_data, pattern[: min(pattern.nbytes, sizes[-1] - start)], start)
        os.fsync(fd_data)
        for nbytes in sizes:
            buffer = allocate(request, uint8, (nbytes,)).data
            for direction in directions:
                for cache in caches if direction == "read" else ("-",):
                    context = _tune_one(
                        active, direction, cache, fd_data, write_path, buffer, check, max_calls
                    )
                    if context is not None:
                        tuned[context.key()] = context
    finally:
        os.close(fd_data)
        for name in (data_path, write_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)


def _tune_arrays(
    active: dispatch.Dispatcher,
    directory: str | os.PathLike[str],
    device: Any,
    arrays: Any,
    directions: Sequence[str],
    caches: Sequence[str],
    check: bool,
    max_calls: int,
    tuned: dict[str, Context],
) -> None:
    """Save ``arrays``, then load them in each cache state of ``caches``, until each of
    their batches' contexts stops exploring."""
    from ._load import load
    from ._save import save

    fd, path = tempfile.mkstemp(prefix=".arrayio-tune-", suffix=".safetensors", dir=directory)
    os.close(fd)

    def steps() -> Iterable[tuple[Callable[[], None], Callable[[], Any]]]:
        """(what prepares a call, the call) per context to tune."""
        if "write" in directions:
            yield (lambda: None), (lambda: save(path, arrays))
        if "read" in directions:
            for cache in caches:
                yield (
                    functools.partial(_evict if cache == "cold" else _warm, path),
                    lambda: load(path, device=device, verify=check),
                )

    def batch_of(prepare: Callable[[], None], call: Callable[[], Any]) -> Context | None:
        prepare()
        active.last_batch = None
        call()
        # None: no batch to learn (arrays too small or too few)
        return active.last_batch[0] if active.last_batch is not None else None

    try:
        save(path, arrays)  # the file the loads read
        for prepare, call in steps():
            context = _until_learned(active, functools.partial(batch_of, prepare, call), max_calls)
            if context is not None:
                tuned[context.key()] = context
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        second_pass.evict(fd)
    finally:
        os.close(fd)


def _warm(path: str) -> None:
    """Read the file into the page cache, unless the loads before left it there."""
    with open(path, "rb", buffering=0) as f:
        if cache_state(f.fileno(), 0, os.fstat(f.fileno()).st_size) == "warm":
            return
        chunk = bytearray(16 << 20)
        while f.readinto(chunk):
            pass


def _is_gpu(device: Any) -> bool:
    return device is not None and parse_target(None, device).placement.is_cuda


def _tune_one(
    active: dispatch.Dispatcher,
    direction: str,
    cache: str,
    fd_data: int,
    write_path: str,
    buffer: Any,
    check: bool,
    max_calls: int,
) -> Context | None:
    def transfer() -> Context | None:
        if direction == "read":
            if cache == "cold":
                second_pass.evict(fd_data)
            active.read(fd_data, buffer, 0, with_checksum=check)
        else:
            fd = os.open(write_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                active.write(fd, buffer, 0, with_checksum=check)
            finally:
                os.close(fd)
        # None: a small transfer, never learned
        return active.last[0] if active.last is not None else None

    return _until_learned(active, transfer, max_calls)


def _until_learned(
    active: dispatch.Dispatcher, call: Callable[[], Context | None], max_calls: int
) -> Context | None:
    """Repeat ``call`` (which returns the context it ran in, or None where nothing is
    learned) until its context stops exploring, at most ``max_calls`` times."""
    context = None
    for _ in range(max_calls):
        context = call()
        if context is None or active.policy.explain(context).phase == "exploiting":
            break
    return context
