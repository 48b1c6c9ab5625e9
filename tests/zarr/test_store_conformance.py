"""zarr-python's own store conformance suite (``zarr.testing.store.StoreTests``) for
NVMeStore: with CPU buffers here, with GPU buffers (``zarr.config.enable_gpu()``, so every
``get`` lands in CuPy memory) on a GPU machine."""

from __future__ import annotations

import pytest

zarr = pytest.importorskip("zarr")

from zarr.core.buffer import Buffer, cpu  # noqa: E402
from zarr.testing.store import StoreTests  # noqa: E402

from arrayio.zarr import NVMeStore  # noqa: E402


class TestNVMeStore(StoreTests[NVMeStore, cpu.Buffer]):
    store_cls = NVMeStore
    buffer_cls = cpu.Buffer

    # The suite's own access to the storage, bypassing the store, as for LocalStore.
    async def get(self, store: NVMeStore, key: str) -> Buffer:
        return self.buffer_cls.from_bytes((store.root / key).read_bytes())

    async def set(self, store: NVMeStore, key: str, value: Buffer) -> None:
        path = store.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(value.to_bytes())

    @pytest.fixture
    def store_kwargs(self, tmp_path) -> dict[str, object]:
        return {"root": str(tmp_path)}

    def test_store_repr(self, store: NVMeStore) -> None:
        assert repr(store) == f"NVMeStore('file://{store.root.as_posix()}')"
        assert str(store) == f"file://{store.root.as_posix()}"

    def test_store_supports_writes(self, store: NVMeStore) -> None:
        assert store.supports_writes

    def test_store_supports_listing(self, store: NVMeStore) -> None:
        assert store.supports_listing

    async def test_get_with_prototype_default(self, store: NVMeStore) -> None:
        data = self.buffer_cls.from_bytes(b"\x01\x02\x03\x04")
        await self.set(store, "c/0", data)
        observed = await store.get("c/0", prototype=None)
        assert observed is not None and observed.to_bytes() == data.to_bytes()
        assert isinstance(observed, zarr.core.buffer.default_buffer_prototype().buffer)

    async def test_empty_subdirectory_is_no_key(self, store: NVMeStore) -> None:
        (store.root / "foo" / "bar").mkdir(parents=True)
        assert await store.is_empty("")
        assert await store.get("foo/bar", prototype=None) is None
        assert not await store.exists("foo/bar")


@pytest.mark.gpu
class TestNVMeStoreGPU(TestNVMeStore):
    """The same suite with zarr's GPU buffers as the default prototype."""

    @pytest.fixture(autouse=True)
    def _gpu_buffers(self):
        with zarr.config.enable_gpu():
            yield

    @property
    def buffer_cls(self):  # type: ignore[override]  # imported only when the test runs
        from zarr.core.buffer import gpu

        return gpu.Buffer

    async def test_get_with_prototype_default(self, store: NVMeStore) -> None:
        import cupy

        await super().test_get_with_prototype_default(store)
        observed = await store.get("c/0", prototype=None)
        assert isinstance(observed.as_array_like(), cupy.ndarray)
