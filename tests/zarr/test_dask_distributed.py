"""NVMeStore under ``dask.distributed`` with worker processes: the store pickles, each worker
reads its chunks through its own dispatcher, and ``from_zarr``/``to_zarr`` round trips."""

from __future__ import annotations

import os

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

from zarr.storage import LocalStore  # noqa: E402

from arrayio.zarr import NVMeStore  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _reader_pid(store: NVMeStore, key: str) -> tuple[int, bytes]:
    """Runs on a worker: which process read ``key``, and what it read."""
    value = store.get_sync(key)
    return os.getpid(), value.to_bytes() if value is not None else b""


def test_worker_processes_read_and_write_through_the_store(tmp_path):
    data = np.random.default_rng(4).normal(size=(64, 48))
    z = zarr.create_array(NVMeStore(tmp_path / "a"), shape=data.shape, chunks=(16, 16), dtype="f8")
    z[:] = data
    with (
        distributed.LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            dashboard_address=None,
            silence_logs=40,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        store = NVMeStore(tmp_path / "a", read_only=True)
        x = da.from_zarr(zarr.open_array(store, mode="r"))
        np.testing.assert_array_equal(x.compute(), data)
        da.to_zarr(x * 2, NVMeStore(tmp_path / "b"))
        pids = client.gather(
            [
                client.submit(_reader_pid, store, "c/0/0", pure=False, workers=[worker])
                for worker in client.scheduler_info()["workers"]
            ]
        )
    assert len({pid for pid, _ in pids}) == 2 and os.getpid() not in {pid for pid, _ in pids}
    assert all(value == (tmp_path / "a" / "c" / "0" / "0").read_bytes() for _, value in pids)
    np.testing.assert_array_equal(
        zarr.open_array(LocalStore(tmp_path / "b"), mode="r")[:], 2 * data
    )
