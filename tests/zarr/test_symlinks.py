"""NVMeStore and symbolic links: no key reads, writes, deletes or lists anything outside the
root through a link unless the store is built with ``follow_symlinks=True``; links that stay
inside the root are followed; the root itself may be a link. The tests of links run twice:
with openat2 where the kernel has it, and as on kernels without it."""

from __future__ import annotations

import asyncio
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

from zarr.abc.store import RangeByteRequest  # noqa: E402
from zarr.core.buffer import cpu  # noqa: E402
from zarr.core.sync import _collect_aiterator  # noqa: E402

import arrayio  # noqa: E402
from arrayio.zarr import InvalidKeyError, NVMeStore  # noqa: E402
from arrayio.zarr import _keys as keys_module  # noqa: E402

CPU = cpu.buffer_prototype
SECRET = b"bytes that live outside the store"


def buffer(data: bytes) -> cpu.Buffer:
    return cpu.Buffer.from_bytes(data)


def collect(iterator) -> list:
    return list(asyncio.run(_collect_aiterator(iterator)))


def tree(directory: Path) -> dict[str, bytes | None]:
    """Every file below ``directory`` with its bytes, every directory as None."""
    found: dict[str, bytes | None] = {}
    for folder, folders, files in os.walk(directory):
        for name in folders:
            found[os.path.relpath(os.path.join(folder, name), directory)] = None
        for name in files:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, directory)] = Path(path).read_bytes()
    return found


@pytest.fixture(params=["openat2", "without openat2"])
def kernel(request, monkeypatch) -> None:
    if request.param == "without openat2":
        monkeypatch.setattr(keys_module, "_openat2", lambda: None)


@pytest.fixture
def escapes(tmp_path, kernel) -> tuple[Path, Path]:
    """A store root holding links out of it, and the directory they lead to::

    root/zarr.json                      a key
    root/leak   -> outside/secret       a file link at the leaf (absolute target)
    root/out    -> outside              a directory link at the leaf (absolute target)
    root/a/leak -> ../../outside/secret a file link one level down (relative target)
    root/a/out  -> ../../outside        a directory link one level down (relative target)
    outside/secret, outside/sub/secret
    """
    outside, root = tmp_path / "outside", tmp_path / "root"
    (outside / "sub").mkdir(parents=True)
    (outside / "secret").write_bytes(SECRET)
    (outside / "sub" / "secret").write_bytes(SECRET)
    (root / "a").mkdir(parents=True)
    (root / "zarr.json").write_bytes(b"{}")
    (root / "leak").symlink_to(outside / "secret")
    (root / "out").symlink_to(outside)
    (root / "a" / "leak").symlink_to("../../outside/secret")
    (root / "a" / "out").symlink_to("../../outside")
    return root, outside


def refused(call, key: str) -> None:
    """``call()`` must raise InvalidKeyError saying that ``key`` leaves through a link."""
    with pytest.raises(InvalidKeyError) as caught:
        call()
    message = str(caught.value)
    assert repr(key) in message and "symbolic link" in message, message
    assert "follow_symlinks=True" in message, message
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, arrayio.ArrayioError)


# Keys whose value lies outside: a file link at the leaf, or a directory link on the way.
LINKED_FILES = ["leak", "a/leak"]
THROUGH_LINKED_DIRECTORIES = ["out/secret", "out/sub/secret", "a/out/secret", "a/out/sub/secret"]
ESCAPING_KEYS = LINKED_FILES + THROUGH_LINKED_DIRECTORIES


def _ranges(store: NVMeStore, key: str) -> bytes:
    got = dict(
        store.get_ranges_sync(
            key, [RangeByteRequest(0, 5), RangeByteRequest(5, 1000)], prototype=CPU
        )
    )
    return got[0].to_bytes() + got[1].to_bytes()


# Every read, each giving back the bytes it read (or what it learnt) of the key's value.
READS = {
    "get": lambda s, k: asyncio.run(s.get(k, CPU)).to_bytes(),
    "get_sync": lambda s, k: s.get_sync(k).to_bytes(),
    "get_sync with a range": lambda s, k: s.get_sync(
        k, byte_range=RangeByteRequest(0, 1000)
    ).to_bytes(),
    "get_partial_values": lambda s, k: asyncio.run(
        s.get_partial_values(CPU, [("zarr.json", None), (k, None)])
    )[1].to_bytes(),
    "_get_many": lambda s, k: collect(s._get_many([(k, CPU, None)]))[0][1].to_bytes(),
    "get_ranges_sync": _ranges,
    "exists": lambda s, k: asyncio.run(s.exists(k)),
    "getsize": lambda s, k: asyncio.run(s.getsize(k)),
}
READ_OUTSIDE = {"exists": True, "getsize": len(SECRET)}  # the others: SECRET itself


@pytest.mark.parametrize("key", ESCAPING_KEYS)
@pytest.mark.parametrize("read", READS)
def test_reads_do_not_follow_links_out_of_the_root(escapes, read, key):
    root, _ = escapes
    refused(lambda: READS[read](NVMeStore(root, read_only=True), key), key)


@pytest.mark.parametrize("key", ESCAPING_KEYS)
@pytest.mark.parametrize("read", READS)
def test_follow_symlinks_restores_reads_out_of_the_root(escapes, read, key):
    root, _ = escapes
    store = NVMeStore(root, read_only=True, follow_symlinks=True)
    assert READS[read](store, key) == READ_OUTSIDE.get(read, SECRET)


WRITES = {
    "set": lambda s, k: asyncio.run(s.set(k, buffer(b"written"))),
    "set_sync": lambda s, k: s.set_sync(k, buffer(b"written")),
    "set_if_not_exists": lambda s, k: asyncio.run(s.set_if_not_exists(k, buffer(b"written"))),
}
# Through a linked directory: over an outside file, beside it, and in directories the write
# would create outside.
WRITTEN_THROUGH_LINKS = [
    "out/secret",
    "out/new",
    "a/out/sub/new",
    "out/made/new",
    "a/out/made/deeper/new",
]


@pytest.mark.parametrize("key", WRITTEN_THROUGH_LINKS)
@pytest.mark.parametrize("write", WRITES)
def test_writes_do_not_follow_links_out_of_the_root(escapes, write, key):
    root, outside = escapes
    before = tree(outside)
    refused(lambda: WRITES[write](NVMeStore(root), key), key)
    assert tree(outside) == before


@pytest.mark.parametrize("write", WRITES)
def test_follow_symlinks_restores_writes_out_of_the_root(escapes, write):
    root, outside = escapes
    WRITES[write](NVMeStore(root, follow_symlinks=True), "a/out/made/new")
    assert (outside / "made" / "new").read_bytes() == b"written"


@pytest.mark.parametrize("follow_symlinks", [False, True])
@pytest.mark.parametrize("key", ["leak", "a/leak", "out"])
def test_a_write_replaces_a_link_at_the_key_and_never_writes_through_it(
    escapes, key, follow_symlinks
):
    # Atomic writes rename a new file over the key: the link goes, its target stays.
    root, outside = escapes
    before = tree(outside)
    NVMeStore(root, follow_symlinks=follow_symlinks).set_sync(key, buffer(b"mine"))
    assert not (root / key).is_symlink()
    assert (root / key).read_bytes() == b"mine"
    assert tree(outside) == before


DELETES = {
    "delete": lambda s, k: asyncio.run(s.delete(k)),
    "delete_sync": lambda s, k: s.delete_sync(k),
    "delete_dir": lambda s, k: asyncio.run(s.delete_dir(k)),
}
DELETED_THROUGH_LINKS = ["out/secret", "out/sub", "a/out/sub/secret", "a/out/sub"]


@pytest.mark.parametrize("key", DELETED_THROUGH_LINKS)
@pytest.mark.parametrize("delete", DELETES)
def test_deletes_do_not_follow_links_out_of_the_root(escapes, delete, key):
    root, outside = escapes
    before = tree(outside)
    refused(lambda: DELETES[delete](NVMeStore(root), key), key)
    assert tree(outside) == before


@pytest.mark.parametrize("delete", DELETES)
def test_follow_symlinks_restores_deletes_out_of_the_root(escapes, delete):
    root, outside = escapes
    DELETES[delete](NVMeStore(root, follow_symlinks=True), "a/out/sub")
    assert not (outside / "sub").exists()


@pytest.mark.parametrize("follow_symlinks", [False, True])
@pytest.mark.parametrize("delete", DELETES)
def test_a_delete_removes_a_link_at_the_key_not_its_target(escapes, delete, follow_symlinks):
    root, outside = escapes
    before = tree(outside)
    store = NVMeStore(root, follow_symlinks=follow_symlinks)
    for key in ["out", "a/out"] if delete == "delete_dir" else ["leak", "a/leak", "out"]:
        DELETES[delete](store, key)
        assert not os.path.lexists(root / key)
    assert tree(outside) == before


@pytest.mark.parametrize("follow_symlinks", [False, True])
def test_clear_removes_the_links_and_nothing_outside(escapes, follow_symlinks):
    root, outside = escapes
    before = tree(outside)
    asyncio.run(NVMeStore(root, follow_symlinks=follow_symlinks).clear())
    assert os.listdir(root) == []
    assert tree(outside) == before


LISTINGS = {
    "list": lambda s, p: collect(s.list()),
    "list_prefix": lambda s, p: collect(s.list_prefix(p)),
    "list_dir": lambda s, p: collect(s.list_dir(p)),
    "getsize_prefix": lambda s, p: asyncio.run(s.getsize_prefix(p)),
}


def test_listing_shows_no_link_out_of_the_root(escapes):
    # A link out of the root is no key of the store: listing skips it, so that one stray
    # link does not make a whole hierarchy unlistable; reading it by name is refused.
    root, _ = escapes
    store = NVMeStore(root, read_only=True)
    assert sorted(LISTINGS["list"](store, "")) == ["zarr.json"]
    assert sorted(LISTINGS["list_prefix"](store, "")) == ["zarr.json"]
    assert sorted(LISTINGS["list_prefix"](store, "a/")) == []
    assert sorted(LISTINGS["list_dir"](store, "")) == ["a", "zarr.json"]
    assert sorted(LISTINGS["list_dir"](store, "a")) == []
    assert LISTINGS["getsize_prefix"](store, "") == len(b"{}")
    assert asyncio.run(store.is_empty("a"))


# A prefix without a '/' makes list_prefix walk the root and filter by name: nothing to refuse.
BELOW_LINKS = [
    (listing, prefix)
    for listing in ["list_dir", "getsize_prefix"]
    for prefix in ["out", "out/", "out/sub", "a/out", "a/out/sub/"]
]
BELOW_LINKS += [("list_prefix", prefix) for prefix in ["out/", "out/s", "a/out/", "a/out/sub/s"]]


@pytest.mark.parametrize(("listing", "prefix"), BELOW_LINKS)
def test_listing_below_a_link_out_of_the_root_is_refused(escapes, listing, prefix):
    root, _ = escapes
    refused(lambda: LISTINGS[listing](NVMeStore(root, read_only=True), prefix), prefix)


def test_follow_symlinks_restores_listing_out_of_the_root(escapes):
    root, _ = escapes
    store = NVMeStore(root, read_only=True, follow_symlinks=True)
    assert "leak" in LISTINGS["list"](store, "")
    assert sorted(LISTINGS["list_prefix"](store, "out/")) == ["out/secret", "out/sub/secret"]
    assert sorted(LISTINGS["list_dir"](store, "a/out")) == ["secret", "sub"]
    assert LISTINGS["getsize_prefix"](store, "a/out") == 2 * len(SECRET)


# --------------------------------------------------------------------------- links inside


@pytest.fixture
def inside(tmp_path, kernel) -> tuple[NVMeStore, np.ndarray]:
    """A store holding an array ``arr`` and links to it that stay inside the root::

    alias -> arr                 a relative directory link
    absolute -> <root>/arr       an absolute directory link
    round -> ../root/arr         leaves the root by name but resolves back inside
    arr/c/9 -> 0                 a file link
    """
    root = tmp_path / "root"
    data = np.arange(40, dtype=np.int32)
    zarr.create_array(NVMeStore(root), name="arr", data=data, chunks=(10,))
    (root / "alias").symlink_to("arr")
    (root / "absolute").symlink_to(root / "arr")
    (root / "round").symlink_to("../root/arr")
    (root / "arr" / "c" / "9").symlink_to("0")
    return NVMeStore(root), data


def test_links_inside_the_root_are_followed(inside):
    store, data = inside
    chunk = store.get_sync("arr/c/0").to_bytes()
    for key in ["arr/c/9", "alias/c/0", "absolute/c/0", "round/c/0", "alias/c/9"]:
        assert store.get_sync(key).to_bytes() == chunk, key
        assert asyncio.run(store.exists(key)) and asyncio.run(store.getsize(key)) == len(chunk)
    for name in ["alias", "absolute", "round"]:
        np.testing.assert_array_equal(zarr.open_array(store, path=name, mode="r")[:], data)
    store.set_sync("alias/c/5", buffer(b"through the alias"))
    assert (store.root / "arr" / "c" / "5").read_bytes() == b"through the alias"
    store.delete_sync("round/c/5")
    assert not (store.root / "arr" / "c" / "5").exists()


def test_listing_lists_file_links_inside_and_does_not_descend_linked_directories(inside):
    # As os.walk and LocalStore do: a directory link may form a cycle.
    store, _ = inside
    keys = collect(store.list())
    assert "arr/c/9" in keys and not any(key.startswith(("alias", "round")) for key in keys)
    assert sorted(collect(store.list_dir(""))) == ["absolute", "alias", "arr", "round", "zarr.json"]
    assert sorted(collect(store.list_prefix("alias/c/"))) == [
        f"alias/c/{i}" for i in [0, 1, 2, 3, 9]
    ]
    assert asyncio.run(store.getsize_prefix("alias/c")) == asyncio.run(
        store.getsize_prefix("arr/c")
    )


def test_delete_dir_of_a_link_inside_removes_only_the_link(inside):
    store, data = inside
    asyncio.run(store.delete_dir("alias"))
    assert not os.path.lexists(store.root / "alias")
    np.testing.assert_array_equal(zarr.open_array(store, path="arr", mode="r")[:], data)


# --------------------------------------------------------------------------- the root


def test_a_root_that_is_a_link_works(tmp_path, kernel):
    (tmp_path / "disk").mkdir()
    (tmp_path / "scratch").symlink_to(tmp_path / "disk")
    root = tmp_path / "scratch" / "link-to-data.zarr"
    (tmp_path / "disk" / "data.zarr").mkdir()
    root.symlink_to("data.zarr")
    data = np.arange(30, dtype=np.float32).reshape(5, 6)
    zarr.create_array(NVMeStore(root), name="x", data=data, chunks=(2, 3))
    store = NVMeStore(root)
    np.testing.assert_array_equal(zarr.open_array(store, path="x", mode="r")[:], data)
    assert "x/c/0/0" in collect(store.list()) and collect(store.list_dir("x/c")) != []
    assert asyncio.run(store.getsize_prefix("x")) > 0
    asyncio.run(store.delete_dir("x"))
    assert collect(store.list()) == ["zarr.json"]
    assert root.is_symlink()


def test_the_option_survives_copies_of_the_store(tmp_path):
    store = NVMeStore(tmp_path, follow_symlinks=True)
    for copy in [
        pickle.loads(pickle.dumps(store)),
        store.with_read_only(True),
        asyncio.run(NVMeStore.open(tmp_path, follow_symlinks=True)),
    ]:
        assert copy.follow_symlinks and copy == store
    assert NVMeStore(tmp_path) != store
    assert "follow_symlinks=True" in repr(store) and "follow_symlinks" not in repr(
        NVMeStore(tmp_path)
    )


def test_keys_without_links_cost_no_check_where_openat2_runs(tmp_path, monkeypatch):
    # The kernel refuses links on the way itself: where it can, nothing is resolved per key.
    if keys_module._openat2() is None:
        pytest.skip("this kernel does not run openat2")
    store = NVMeStore(tmp_path)
    store.set_sync("c/0/0", buffer(b"plain"))

    def unexpected(*args):
        raise AssertionError("a key without links was resolved")

    monkeypatch.setattr(keys_module, "_real_path_of", unexpected)
    monkeypatch.setattr(os.path, "realpath", unexpected)
    assert store.get_sync("c/0/0").to_bytes() == b"plain"
    assert asyncio.run(store.exists("c/0/0")) and store.get_sync("c/0/1") is None
    store.set_sync("c/0/1", buffer(b"more"))
    assert sorted(collect(store.list())) == ["c/0/0", "c/0/1"]
