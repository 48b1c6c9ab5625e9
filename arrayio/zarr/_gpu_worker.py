"""The GPU worker: one thread per GPU runs all of the zstd codec's nvCOMP work.

Whatever requests wait for it when it picks up work go to nvCOMP as one batch, which is
where the chunks of zarr's concurrent decode and encode calls meet.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import queue
import threading
from typing import Any, ClassVar

from ..errors import FrameworkNotAvailableError
from ._frames import decode_on_host, encode_on_host
from ._nvcomp import NvcompZstd

__all__ = ["INSTALL_HINT", "DeviceWorker"]

INSTALL_HINT = (
    "decoding zstd chunks in GPU memory needs CuPy and nvCOMP: "
    "pip install 'arrayio[gpu]' (cupy-cuda13x, nvidia-nvcomp-cu13, nvidia-libnvcomp-cu13)"
)


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """Chunks of one codec call, waiting for the worker."""

    kind: str  # "decode" or "encode"
    arrays: list[Any]  # CuPy arrays, or spans of device bytes (_kernels.DeviceSpan)
    zstd: Any  # numcodecs' Zstd with the codec's level and checksum, for the host fallback
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    # Where each decoded chunk may go (device bytes of its size, a CuPy array or a span, or
    # None): the caller's output, when the chunk lands there whole
    destinations: list[Any] | None = None

    @property
    def group(self) -> tuple[str, int, bool]:
        return (self.kind, self.zstd.level, bool(getattr(self.zstd, "checksum", False)))


class DeviceWorker:
    """The one thread that codes zstd on one GPU.

    It owns nvCOMP's handles for its whole life (a daemon thread, so they are never torn
    down under a running interpreter), and it coalesces: whatever requests are waiting
    when it picks up work go to nvCOMP as one batch. zarr's pipeline hands a codec
    ``codec_pipeline.batch_size`` chunks at a time (1 by default) from up to
    ``async.concurrency`` tasks, so this is where their chunks meet.
    """

    _workers: ClassVar[dict[int, DeviceWorker]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id
        self.jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._serve, daemon=True, name=f"arrayio-zstd-cuda{device_id}"
        )
        self.thread.start()

    @classmethod
    def submit(
        cls,
        device_id: int,
        kind: str,
        arrays: list[Any],
        zstd: Any,
        destinations: list[Any] | None = None,
    ) -> concurrent.futures.Future:
        """Queue chunks for the device's worker; the future gives one result each: a
        decoded chunk's destination, where it was given one and nvCOMP decoded it, else a
        new CuPy array."""
        with cls._lock:
            worker = cls._workers.get(device_id)
            if worker is None:
                worker = cls._workers[device_id] = cls(device_id)
        job = Job(kind, arrays, zstd, destinations=destinations)
        worker.jobs.put(job)
        return job.future

    def _serve(self) -> None:
        gpu: NvcompZstd | None = None
        while True:
            jobs = [self.jobs.get()]
            while True:
                try:
                    jobs.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            try:
                gpu = gpu or NvcompZstd(self.device_id)
            except Exception as error:  # noqa: BLE001 - every waiting caller gets it
                failure: Exception = error
                if isinstance(error, ImportError):
                    failure = FrameworkNotAvailableError(INSTALL_HINT)
                    failure.__cause__ = error
                for job in jobs:
                    job.future.set_exception(failure)
                continue
            groups: dict[tuple[str, int, bool], list[Job]] = {}
            for job in jobs:
                groups.setdefault(job.group, []).append(job)
            for (kind, _, checksum), group in groups.items():
                self._run(gpu, kind, checksum, group)

    @staticmethod
    def _run(gpu: NvcompZstd, kind: str, checksum: bool, jobs: list[Job]) -> None:
        arrays = [array for job in jobs for array in job.arrays]
        destinations = [
            place for job in jobs for place in (job.destinations or [None] * len(job.arrays))
        ]
        zstd = jobs[0].zstd
        try:
            if kind == "decode":
                results = gpu.decode(arrays, lambda data: decode_on_host(zstd, data), destinations)
            else:
                results = gpu.encode(arrays, checksum, lambda data: encode_on_host(zstd, data))
        except BaseException as error:  # noqa: BLE001 - the callers get it, the worker lives
            for job in jobs:
                job.future.set_exception(error)
            return
        start = 0
        for job in jobs:
            mine = results[start : start + len(job.arrays)]
            start += len(job.arrays)
            failed = [r for r in mine if isinstance(r, BaseException)]
            if failed:
                job.future.set_exception(failed[0])
            else:
                job.future.set_result(mine)


# A forked child has the workers' queues but not their threads: it starts its own.
os.register_at_fork(after_in_child=DeviceWorker._workers.clear)
