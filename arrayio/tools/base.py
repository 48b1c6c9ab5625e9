"""The contract every transfer tool fulfils.

A tool moves a byte range between a file and a buffer: a host buffer (a flat, C-contiguous
NumPy ``uint8`` array) or device memory (a :class:`~arrayio.arrays._buffers.DeviceBuffer`). Each
operation has a non-blocking form returning an :class:`IOFuture` (``pread``/``pwrite``, as
KvikIO's ``CuFile``) and a blocking twin (``read``/``write``) that is just ``.get()``.

A tool states what it can do (:class:`Capabilities`) and whether it can run here
(:meth:`Tool.availability`, with the reason when it cannot); the dispatcher only offers it
work it declares it can do. A tool may raise on any call (O_DIRECT refused by the file
system, a KvikIO error): the dispatcher then marks it unavailable for that context and
retries the whole range with another tool, which is safe because a read fills the whole
destination again and a write rewrites the whole range.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar, cast

import numpy as np

from ..arrays._buffers import DeviceBuffer
from ..errors import ToolUnavailableError
from ..integrity._checksum import ChecksumParts

__all__ = [
    "Availability",
    "Capabilities",
    "Buffer",
    "DeviceRanges",
    "IOFuture",
    "ReadsOnly",
    "Tool",
    "buffer_kind",
]

T = TypeVar("T")

Buffer = np.ndarray | DeviceBuffer
"""Host memory (flat ``uint8`` NumPy array) or device memory."""


def buffer_kind(buffer: Buffer) -> str:
    """``"host"`` or ``"cuda"``."""
    return "host" if isinstance(buffer, np.ndarray) else "cuda"


class IOFuture(Generic[T]):
    """The result of a non-blocking operation: ``get()`` waits and returns it (or raises)."""

    __slots__ = ("_future", "_value")

    def __init__(self, future: Future[T] | None = None, value: T | None = None) -> None:
        self._future = future
        self._value = value

    @classmethod
    def completed(cls, value: T) -> IOFuture[T]:
        """A future that is already done (for tools that work synchronously)."""
        return cls(None, value)

    @classmethod
    def gather(
        cls, futures: list[IOFuture[int]], finish: Callable[[int], T] | None = None
    ) -> IOFuture[Any]:
        """A future for the sum of several byte counts (and an optional final step)."""
        return _Gathered(futures, finish)

    def get(self) -> T:
        """Wait for the operation and return its result (bytes moved), or raise its error."""
        if self._future is not None:
            return self._future.result()
        return self._value  # type: ignore[return-value]

    def done(self) -> bool:
        """Whether the operation has finished."""
        return self._future is None or self._future.done()


class _Gathered(IOFuture[Any]):
    __slots__ = ("_parts", "_finish")

    def __init__(self, parts: list[IOFuture[int]], finish: Callable[[int], Any] | None) -> None:
        super().__init__()
        self._parts = parts
        self._finish = finish

    def get(self) -> Any:
        total = 0
        error: BaseException | None = None
        for part in self._parts:  # wait for every part, even after a failure
            try:
                total += part.get()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
        if error is not None:
            raise error
        return self._finish(total) if self._finish is not None else total

    def done(self) -> bool:
        return all(part.done() for part in self._parts)


@dataclasses.dataclass(frozen=True, slots=True)
class Capabilities:
    """What a tool can do.

    Attributes
    ----------
    memory
        The memory kinds it serves: ``"host"``, ``"cuda"``.
    directions
        ``"read"``, ``"write"``.
    alignment
        The alignment it needs of file offsets, sizes and host addresses; 1 means any. Tools
        that need more must still accept any request (by bouncing through aligned buffers),
        so this is a statement about speed, not a precondition.
    checksums
        Whether it can report the CRC-32C of the bytes it moves (into a
        :class:`~arrayio.integrity._checksum.ChecksumParts`) while they pass through host memory.
    """

    memory: frozenset[str]
    directions: frozenset[str] = frozenset({"read", "write"})
    alignment: int = 1
    checksums: bool = True

    def serves(self, direction: str, memory: str) -> bool:
        return direction in self.directions and memory in self.memory


@dataclasses.dataclass(frozen=True, slots=True)
class Availability:
    """Whether a tool can run here, and if not, why."""

    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


class Tool(abc.ABC):
    """A way to move bytes between a file and memory; see the module docstring.

    Subclasses set ``name`` and ``capabilities`` and implement :meth:`pread` and
    :meth:`pwrite`. Their tunable parameters (thread count, task size...) are keyword
    arguments of the constructor, reported by :attr:`params`, so that the dispatcher can
    learn a tool *with* its parameters.
    """

    name: str = "tool"
    capabilities: Capabilities = Capabilities(frozenset({"host"}))

    def __init__(self, **params: Any) -> None:
        self._params = dict(params)
        # Seconds of each step of :meth:`prepare` (importing, starting threads, pinning), as
        # the tool times them with :meth:`set_up_step`: what a set-up costs, and where.
        self.set_up_steps: dict[str, float] = {}

    @contextlib.contextmanager
    def set_up_step(self, name: str) -> Iterator[None]:
        """Time a step of :meth:`prepare` into :attr:`set_up_steps`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.set_up_steps[name] = self.set_up_steps.get(name, 0.0) + seconds

    @property
    def params(self) -> dict[str, Any]:
        """The tool's parameters, as given to its constructor."""
        return dict(self._params)

    @property
    def label(self) -> str:
        """``name`` and parameters, e.g. ``posix(threads=8,task_size=4194304)``."""
        inner = ",".join(f"{k}={v}" for k, v in sorted(self._params.items()))
        return f"{self.name}({inner})" if inner else self.name

    @classmethod
    def availability(cls) -> Availability:
        """Whether the tool can run on this machine (libraries, drivers); cheap and cached."""
        return Availability(True)

    @abc.abstractmethod
    def pread(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        """Start reading ``buffer.nbytes`` bytes at ``file_offset`` into ``buffer``.

        The future gives the number of bytes read: fewer than ``buffer.nbytes`` only when the
        file ends first (the rest of ``buffer`` is then unspecified). With ``checksum`` (only
        passed to tools whose capabilities say ``checksums``), the tool records the CRC-32C
        of every byte it read, in pieces, before the future completes.

        Device memory comes with nothing queued that writes it: a tool copies on streams of
        its own, not ordered after the caller's, and arrayio's reads wait for the caller's
        current streams before any tool runs
        (:func:`~arrayio.arrays._buffers.wait_for_current_streams`).
        """

    @abc.abstractmethod
    def pwrite(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        """Start writing all of ``buffer`` at ``file_offset``; the future gives the byte count.

        With ``checksum``, the tool records the CRC-32C of the bytes it wrote.
        """

    def read(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> int:
        """Blocking :meth:`pread`."""
        return self.pread(fd, buffer, file_offset, checksum=checksum).get()

    def write(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> int:
        """Blocking :meth:`pwrite`."""
        return self.pwrite(fd, buffer, file_offset, checksum=checksum).get()

    # Seconds a process's first use of the tool costs beyond its transfer (importing and
    # loading libraries), paid once: the dispatcher has another tool stand in for it on
    # calls too short to hide that, and sets it up in the background (see
    # :meth:`Policy.run <arrayio.dispatch.policy.Policy.run>`). Zero for tools whose set-up
    # grows with their use (threads, the pinned buffers a transfer needs).
    setup_seconds = 0.0

    @classmethod
    def read_ahead(cls) -> None:
        """Ask for the files :meth:`prepare` will read (a library's, for its import), where
        reading them costs a set-up in the background: the dispatcher calls it on the
        caller's thread before a read from the disk that the set-up runs beside, so that
        the disk serves them ahead of the read's requests. Nothing by default."""
        return

    def prepare(self) -> None:  # noqa: B027 - optional hook, nothing to set up by default
        """Set up what the first transfer would (threads, pinned buffers, libraries), so
        that it measures the transfer alone; the dispatcher calls it in the background
        before it measures a new arm on a user's call."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release threads and buffers; the tool may be used again afterwards."""

    def __repr__(self) -> str:
        return f"<arrayio tool {self.label}>"


class ReadsOnly:
    """For a tool that only reads (its capabilities say so): a write raises."""

    name: str

    def pwrite(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        """Not supported: the capabilities say reads only, so the dispatcher never asks.

        Raises
        ------
        ToolUnavailableError
            Always.
        """
        raise ToolUnavailableError(f"{self.name} reads only; use another tool to write")


class DeviceRanges(abc.ABC):
    """For a tool that moves device memory only and reads several buffers as one range of
    the file (``preadv``): a read of one buffer is a range of one."""

    name: str

    def pread(
        self, fd: int, buffer: Buffer, file_offset: int, *, checksum: ChecksumParts | None = None
    ) -> IOFuture[int]:
        device_only(self.name, buffer)
        return self.preadv(fd, [(file_offset, buffer)], checksums=[checksum])

    @abc.abstractmethod
    def preadv(
        self,
        fd: int,
        requests: Sequence[tuple[int, Buffer]],
        *,
        checksums: Sequence[ChecksumParts | None] | None = None,
    ) -> IOFuture[int]:
        """Start filling each ``(file_offset, buffer)`` of ``requests`` (device memory, one
        GPU, in file order, none overlapping) as one range of the file, from the first
        nonempty request's offset to the last's end; ``checksums[i]``, when given, receives
        buffer ``i``'s bytes. The future gives the bytes of the range read: all of it, or up
        to the end of the file."""


def one_gpu(name: str, requests: Sequence[tuple[int, Buffer]]) -> list[DeviceBuffer]:
    """The buffers of ``requests``, refused unless every one is device memory and those that
    hold bytes are of one GPU.

    Raises
    ------
    TypeError
        For a host buffer.
    ValueError
        For buffers of several GPUs.
    """
    buffers = []
    for _, buffer in requests:
        device_only(name, buffer)
        buffers.append(cast(DeviceBuffer, buffer))
    if len({buffer.device_index for buffer in buffers if buffer.nbytes}) > 1:
        raise ValueError("preadv takes buffers of one GPU")
    return buffers


def device_only(name: str, buffer: Buffer) -> None:
    """Refuse host memory for a tool that moves device memory only.

    Raises
    ------
    TypeError
        For a host buffer.
    """
    if isinstance(buffer, np.ndarray):
        raise TypeError(f"{name} moves device memory; use another tool for host memory")
