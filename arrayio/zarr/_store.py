"""NVMeStore: a zarr-python 3 store for local files whose bytes move through arrayio.

The store checks its keys (:mod:`arrayio.zarr._keys`), and runs reads
(:mod:`arrayio.zarr._reads`) and writes (:mod:`arrayio.zarr._writes`) on a pool of I/O
threads shared by every store (:mod:`arrayio.zarr._io_pool`). ``docs/design/zarr.md``
explains how the bytes move and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import stat
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zarr.abc.store import ByteRequest, RangeByteRequest, Store
from zarr.core.buffer import Buffer
from zarr.core.buffer.core import default_buffer_prototype

from ..integrity import _atomic
from . import _group_writes
from ._io_pool import executor, in_pool
from ._keys import (
    DIRECTORY,
    LOOKUP,
    MISSING,
    Boundary,
    InvalidKeyError,
    check_key,
    check_prefix,
    files_below,
    split_key,
)
from ._reads import byte_span, read_value
from ._writes import clean_once, delete_at, is_file_at, write_at

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.buffer import BufferPrototype

__all__ = ["InvalidKeyError", "NVMeStore"]


class NVMeStore(Store):
    """A local directory as a zarr v3 store, read and written through arrayio.

    Arrays written by :class:`zarr.storage.LocalStore` open with it and the reverse: the
    layout is the same, a key being a path below the root, one file per key. What differs
    is how the bytes move:

    * reads land in the memory the caller's buffer prototype asks for (NumPy memory for
      zarr's CPU buffers, CuPy memory under ``zarr.config.enable_gpu()``) through arrayio's
      dispatcher, many at once on a pool of I/O threads (``get_partial_values``,
      ``_get_many`` and ``get_ranges_sync`` submit a whole batch);
    * the synchronous surface (``get_sync``, ``set_sync``, ``delete_sync``,
      ``get_ranges_sync``) that zarr's fused codec pipeline calls instead of the async
      methods is the same code, so no path falls back to plain host I/O;
    * writes are atomic and durable (temporary file, fsync, rename): a write that fails
      leaves the previous value in place;
    * keys are checked: one that would leave the root (``..``, an absolute path, a
      backslash or NUL), or that leads out of it through a symbolic link, raises
      :class:`InvalidKeyError` unless the store follows links.

    Parameters
    ----------
    root
        The directory holding the keys; created on open unless ``read_only``. It may be a
        link, or lie below one: the store resolves it once, when first used.
    read_only
        Refuse writes and deletes.
    follow_symlinks
        Let keys lead out of the root through symbolic links, as LocalStore does. By default
        a key whose file or directory resolves outside the root raises
        :class:`InvalidKeyError` (for reads, writes, deletes, sizes and listings below it),
        and listing skips links that lead out: a store unpacked from an archive, or written
        by someone else, then cannot make the program read, overwrite or delete other files
        through a link it holds. Links that stay inside the root are followed either way,
        and the root itself may be a link. A write replaces a link at its key and a delete
        removes it, never what it points to, whatever this says.

    Examples
    --------
    >>> import zarr
    >>> from arrayio.zarr import NVMeStore
    >>> z = zarr.create_array(NVMeStore("data.zarr"), shape=(1000, 1000), chunks=(100, 1000),
    ...                       dtype="f4")
    >>> with zarr.config.enable_gpu():          # chunks read straight into GPU memory
    ...     x = zarr.open_array(NVMeStore("data.zarr", read_only=True))[:]
    """

    supports_writes: bool = True
    supports_deletes: bool = True
    supports_listing: bool = True

    root: Path

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        read_only: bool = False,
        follow_symlinks: bool = False,
    ) -> None:
        super().__init__(read_only=read_only)
        if isinstance(root, str | os.PathLike):
            root = Path(root)
        else:
            raise TypeError(f"root must be a str or os.PathLike, got {type(root).__name__}")
        self.root = root
        self.follow_symlinks = follow_symlinks
        self._root = os.fspath(root)
        self._boundary = Boundary(self._root, follow_symlinks)
        self._cleaned: set[tuple[int, int]] = set()  # directories cleaned of dead temporaries

    # -- identity ---------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, type(self))
            and self.root == other.root
            and self.follow_symlinks == other.follow_symlinks
        )

    __hash__ = None  # type: ignore[assignment]  # mutable open state, like LocalStore

    def __str__(self) -> str:
        return f"file://{self.root.as_posix()}"

    def __repr__(self) -> str:
        following = ", follow_symlinks=True" if self.follow_symlinks else ""
        return f"{type(self).__name__}('{self}'{following})"

    def __getstate__(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "read_only": self.read_only,
            "follow_symlinks": self.follow_symlinks,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(
            state["root"],
            read_only=state["read_only"],  # type: ignore[misc]
            follow_symlinks=state.get("follow_symlinks", False),
        )

    def with_read_only(self, read_only: bool = False) -> Self:
        """A new, unopened store on the same root with this ``read_only``.

        Returns
        -------
        NVMeStore
        """
        return type(self)(self.root, read_only=read_only, follow_symlinks=self.follow_symlinks)

    # -- opening ----------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        root: str | os.PathLike[str],
        *,
        read_only: bool = False,
        mode: str | None = None,
        follow_symlinks: bool = False,
    ) -> Self:
        """Create and open a store (as :meth:`zarr.storage.LocalStore.open`).

        Parameters
        ----------
        root
            The directory.
        read_only
            The store's final read-only state.
        mode
            ``"r"`` or ``"r+"`` require the root to exist already.
        follow_symlinks
            As for the class.

        Returns
        -------
        NVMeStore

        Raises
        ------
        FileNotFoundError
            If the root does not exist and may not be created.
        """
        creating_read_only = mode in ("r", "r+") if mode is not None else read_only
        store = cls(root, read_only=creating_read_only, follow_symlinks=follow_symlinks)
        await store._open()
        if creating_read_only != read_only:
            store = store.with_read_only(read_only)
            await store._open()
        return store

    def _check_root(self) -> None:
        if not self.read_only:
            os.makedirs(self._root, exist_ok=True)
        if not os.path.isdir(self._root):
            raise FileNotFoundError(f"{self._root} does not exist or is not a directory")

    async def _open(self) -> None:
        self._check_root()
        await super()._open()

    async def _ensure_open(self) -> None:
        # Idempotent, unlike Store._open: the many concurrent sets of one batch each get
        # here before any has finished opening.
        self._ensure_open_sync()

    def _ensure_open_sync(self) -> None:
        if not self._is_open:
            self._check_root()
            self._is_open = True

    def _path(self, key: str, *, what: str = "key") -> str:
        return os.path.join(self._root, check_key(key, what=what))

    def _check_writable_key(self, key: str) -> None:
        self._check_writable()
        if not check_key(key) or key.endswith("/"):
            raise InvalidKeyError(f"cannot write or delete key {key!r}: it names a directory")

    def _open_directory(self, relative: str, *, name: str, create: bool = False) -> tuple[int, str]:
        """A descriptor of the directory ``relative`` (``"a/b"``; ``""``: the root), checked
        to be inside the root, and its real path.

        With ``create``, missing directories are made one at a time, each inside its checked
        parent's descriptor, so that none is made outside the root through a link.

        Raises
        ------
        InvalidKeyError
            For a directory outside the root, named ``name`` in the message.
        FileNotFoundError, NotADirectoryError
            If it is missing (and not ``create``) or a file.
        """
        try:
            return self._boundary.open(relative, DIRECTORY, name)
        except FileNotFoundError:
            if not create or not relative:
                raise
        parent, _, base = relative.rpartition("/")
        parent_fd, _ = self._open_directory(parent, name=name, create=True)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(base, dir_fd=parent_fd)
            fd = os.open(base, DIRECTORY, dir_fd=parent_fd)
        finally:
            os.close(parent_fd)
        return fd, self._boundary.admit(fd, os.path.join(self._root, relative), name)

    # -- reads ------------------------------------------------------------------------------

    async def get(
        self,
        key: str,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        """The value of ``key`` (or the part ``byte_range`` selects), or None if missing.

        Parameters
        ----------
        key
            A relative path below the root.
        prototype
            Where the bytes land (zarr's default prototype if None).
        byte_range
            A ``RangeByteRequest``, ``OffsetByteRequest`` or ``SuffixByteRequest``.

        Returns
        -------
        Buffer or None

        Raises
        ------
        InvalidKeyError
            If ``key`` would leave the root.
        """
        path = self._path(key)
        byte_span(byte_range, 0)  # a malformed byte range fails here, present key or not
        await self._ensure_open()
        return await in_pool(
            read_value,
            path,
            prototype or default_buffer_prototype(),
            byte_range,
            self._boundary,
            key,
        )

    def get_sync(
        self,
        key: str,
        *,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        """Synchronous :meth:`get`, in the calling thread (zarr's fused pipeline calls it
        from its own thread pool)."""
        path = self._path(key)
        self._ensure_open_sync()
        return read_value(
            path, prototype or default_buffer_prototype(), byte_range, self._boundary, key
        )

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        """Every ``(key, byte_range)`` at once on the I/O pool; None for missing keys.

        Returns
        -------
        list of Buffer or None
            In the order of ``key_ranges``.
        """
        requests = [(self._path(key), byte_range, key) for key, byte_range in key_ranges]
        await self._ensure_open()
        loop, pool = asyncio.get_running_loop(), executor()
        return list(
            await asyncio.gather(
                *(
                    loop.run_in_executor(
                        pool, read_value, path, prototype, byte_range, self._boundary, key
                    )
                    for path, byte_range, key in requests
                )
            )
        )

    async def _get_many(
        self, requests: Iterable[tuple[str, BufferPrototype, ByteRequest | None]]
    ) -> AsyncGenerator[tuple[str, Buffer | None], None]:
        # All submitted at once, yielded as they complete (the base class awaits each get
        # before starting the next).
        jobs = [
            (key, self._path(key), prototype, byte_range) for key, prototype, byte_range in requests
        ]
        await self._ensure_open()
        loop, pool = asyncio.get_running_loop(), executor()

        async def one(
            key: str, path: str, prototype: BufferPrototype, byte_range: ByteRequest | None
        ) -> tuple[str, Buffer | None]:
            return key, await loop.run_in_executor(
                pool, read_value, path, prototype, byte_range, self._boundary, key
            )

        for done in asyncio.as_completed([one(*job) for job in jobs]):
            yield await done

    def get_ranges_sync(
        self,
        key: str,
        byte_ranges: Sequence[ByteRequest | None],
        *,
        prototype: BufferPrototype,
        max_gap_bytes: int = 1 << 20,
        max_coalesced_bytes: int = 16 << 20,
    ) -> Sequence[tuple[int, Buffer | None]]:
        """Many byte ranges of one key (zarr >= 3.4's sharded reads), ranges near each other
        merged as zarr merges them, and the merged reads run at once on the I/O pool.

        Returns
        -------
        list of (int, Buffer)
            ``(index in byte_ranges, buffer)`` pairs, in no particular order.

        Raises
        ------
        BaseExceptionGroup
            Holding a ``FileNotFoundError`` if ``key`` is missing, as zarr's own version.
        InvalidKeyError
            If ``key`` would leave the root.
        """
        path = self._path(key)
        self._ensure_open_sync()
        try:
            from zarr.core._coalesce import coalesce_ranges
        except ImportError:  # zarr without range coalescing: one read per range
            groups: list[list[tuple[int, RangeByteRequest]]] = []
            alone: list[tuple[int, ByteRequest | None]] = list(enumerate(byte_ranges))
        else:
            groups, alone = coalesce_ranges(
                byte_ranges, max_gap_bytes=max_gap_bytes, max_coalesced_bytes=max_coalesced_bytes
            )
        fetches: list[tuple[list[tuple[int, Any]], ByteRequest | None]] = [
            ([(index, request)], request) for index, request in alone
        ]
        for members in groups:
            if len(members) == 1:
                fetches.append((list(members), members[0][1]))
            else:
                # Not members[0]: nothing here relies on the order of a group's members.
                start = min(r.start for _, r in members)
                fetches.append(
                    (list(members), RangeByteRequest(start, max(r.end for _, r in members)))
                )

        def fetch(
            job: tuple[list[tuple[int, Any]], ByteRequest | None],
        ) -> list[tuple[int, Buffer]]:
            members, request = job
            buffer = read_value(path, prototype, request, self._boundary, key)
            if buffer is None:
                raise FileNotFoundError(key)
            if len(members) == 1:
                return [(members[0][0], buffer)]
            start = request.start  # type: ignore[union-attr]
            return [(index, buffer[r.start - start : r.end - start]) for index, r in members]

        results: list[tuple[int, Buffer | None]] = []
        errors: list[BaseException] = []
        futures = [executor().submit(fetch, job) for job in fetches]
        for future in futures:
            try:
                results.extend(future.result())
            except Exception as error:  # noqa: BLE001 - gathered, raised as one group
                errors.append(error)
        for error in errors:
            if isinstance(error, InvalidKeyError):
                raise error  # the key itself is refused: one error, not one per range
        if errors:
            # zarr 3 needs Python 3.11, which has exception groups.
            raise BaseExceptionGroup(  # noqa: F821
                f"reading ranges of {key!r} failed", errors
            )
        return results

    async def exists(self, key: str) -> bool:
        """Whether ``key`` holds a value (a file, not a directory).

        Raises
        ------
        InvalidKeyError
            If ``key`` would leave the root.
        """
        check_key(key)

        def is_file() -> bool:
            try:
                return stat.S_ISREG(self._status(key).st_mode)
            except OSError:  # as os.path.isfile: missing, below a file, a loop of links
                return False

        return await in_pool(is_file)

    def _status(self, key: str) -> os.stat_result:
        """What ``fstat`` says of the file at the checked ``key``, opened only to look."""
        fd, _ = self._boundary.open(key, LOOKUP, key)
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    async def getsize(self, key: str) -> int:
        """The size in bytes of the value at ``key``.

        Raises
        ------
        FileNotFoundError
            If there is no such key.
        InvalidKeyError
            If ``key`` would leave the root.
        """
        check_key(key)

        def size() -> int:
            try:
                status = self._status(key)
            except NotADirectoryError:  # "a/" or "a/b" below the key "a"
                raise FileNotFoundError(f"no key {key!r} in {self}") from None
            if not stat.S_ISREG(status.st_mode):
                raise FileNotFoundError(f"{key!r} is a prefix, not a key, of {self}")
            return status.st_size

        return await in_pool(size)

    async def getsize_prefix(self, prefix: str) -> int:
        """The total size of the values below ``prefix``, taken as a directory (``"c"``
        counts ``c/0`` but not ``cc/0``), as zarr >= 3.4 does for every store.

        Returns
        -------
        int

        Raises
        ------
        InvalidKeyError
            If ``prefix`` would leave the root.
        """
        folder = check_prefix(prefix).rstrip("/")

        def total() -> int:
            return sum(entry.stat().st_size for _, entry in self._keys_below(folder, name=prefix))

        return await in_pool(total)

    # -- writes -----------------------------------------------------------------------------

    async def set(self, key: str, value: Buffer) -> None:
        """Store ``value`` at ``key``, atomically and durably.

        Raises
        ------
        ValueError
            If the store is read-only.
        InvalidKeyError
            If ``key`` would leave the root or names a directory.
        TypeError
            If ``value`` is not a zarr Buffer.
        """
        self._prepare_write(key, value)
        await self._ensure_open()
        await in_pool(self._write, key, value, False)

    def set_sync(self, key: str, value: Buffer) -> None:
        """Synchronous :meth:`set`, in the calling thread."""
        self._prepare_write(key, value)
        self._ensure_open_sync()
        self._write(key, value, False)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        """Store ``value`` at ``key`` unless it exists; of concurrent callers, one wins."""
        self._prepare_write(key, value)
        await self._ensure_open()
        with contextlib.suppress(FileExistsError):
            await in_pool(self._write, key, value, True)

    def _prepare_write(self, key: str, value: Buffer) -> None:
        self._check_writable_key(key)
        if not isinstance(value, Buffer):
            raise TypeError(
                f"{type(self).__name__}.set(): value must be a zarr Buffer, got "
                f"{type(value).__name__}"
            )

    def _write(self, key: str, value: Buffer, exclusive: bool) -> None:
        folder, name = split_key(key)
        directory, _ = self._open_directory(folder, name=key, create=True)
        try:
            write_at(
                directory, name, value, exclusive, self._cleaned, os.path.join(self._root, key)
            )
        finally:
            os.close(directory)

    def set_many_sync(self, values: Mapping[str, Buffer | None]) -> None:
        """Store every value of ``values`` at its key (None: delete the key), in groups.

        Each key is written as :meth:`set` writes it, atomically and durably, but in groups
        of up to :func:`~arrayio.zarr._group_writes.group_keys`: every value of a group goes
        to a temporary file beside its key on the I/O pool, all at once, each fsynced; only
        once all of them are on disk is each renamed over its key, and each directory is
        fsynced once. A value that fails to stage, or a key whose folder fails its checks,
        leaves every key of its group and of the groups after it as they were (the groups
        before it are written). This is how :class:`arrayio.zarr.CodecPipeline` commits the
        chunks of a write.
        """
        for key, value in values.items():
            if value is None:
                self._check_writable_key(key)
            else:
                self._prepare_write(key, value)
        self._ensure_open_sync()
        writes = [(key, value) for key, value in values.items() if value is not None]
        size = _group_writes.group_keys()
        for start in range(0, len(writes), size):
            group = writes[start : start + size]
            directories: dict[str, int] = {}
            try:
                for key, _ in group:
                    folder, _ = split_key(key)
                    if folder not in directories:
                        opened, _ = self._open_directory(folder, name=key, create=True)
                        directories[folder] = opened
                        clean_once(opened, self._cleaned)
                _group_writes.commit_group(directories, group, self._root)
            finally:
                for directory in directories.values():
                    os.close(directory)
        for key, value in values.items():
            if value is None:
                self._delete(key)

    async def delete(self, key: str) -> None:
        """Remove ``key`` (a directory key: everything below it); a missing key is fine.

        A link at ``key`` is removed, never what it points to.
        """
        self._check_writable_key(key)
        await in_pool(self._delete, key)

    def delete_sync(self, key: str) -> None:
        """Synchronous :meth:`delete`, in the calling thread."""
        self._check_writable_key(key)
        self._ensure_open_sync()
        self._delete(key)

    def _delete(self, key: str, *, refuse_keys: bool = False) -> None:
        """Remove ``key`` from its directory, if both are there; with ``refuse_keys``, raise
        ``ValueError`` for a file instead (for :meth:`delete_dir`)."""
        folder, name = split_key(key)
        try:
            directory, _ = self._open_directory(folder, name=key)
        except MISSING:
            return
        try:
            if refuse_keys and is_file_at(directory, name):
                raise ValueError(f"delete_dir was given {key!r}, which is a key")
            delete_at(directory, name)
        finally:
            os.close(directory)

    async def move(self, dest_root: str | os.PathLike[str]) -> None:
        """Move the store's directory to ``dest_root``, which must not exist (its parent is
        created), as LocalStore's ``move`` does; the store then works there.

        Raises
        ------
        FileExistsError
            If ``dest_root`` exists.
        ValueError
            If the store is read-only.
        """
        self._check_writable()
        destination = Path(dest_root)
        if os.path.lexists(destination):
            raise FileExistsError(f"cannot move {self} to {destination}: it exists")

        def move() -> None:
            os.makedirs(destination.parent, exist_ok=True)
            os.rename(self._root, destination)  # one file system: a rename, whole or not at all

        try:
            await in_pool(move)
        except OSError as error:
            if error.errno != errno.EXDEV:
                raise
            await in_pool(shutil.move, self._root, os.fspath(destination))
        self.root = destination
        self._root = os.fspath(destination)
        self._boundary = Boundary(self._root, self.follow_symlinks)
        self._cleaned = set()

    async def delete_dir(self, prefix: str) -> None:
        """Remove every key below ``prefix`` (all of them for ``""``; the root stays).

        A link at ``prefix`` is removed, never what it points to.

        Raises
        ------
        ValueError
            If ``prefix`` is a key rather than a directory, or the store is read-only.
        InvalidKeyError
            If ``prefix`` would leave the root.
        """
        self._check_writable()
        prefix = check_key(prefix, what="prefix").rstrip("/")

        def remove() -> None:
            if prefix:
                self._delete(prefix, refuse_keys=True)
                return
            try:
                root, _ = self._open_directory("", name="")
            except MISSING:
                return
            try:
                for entry in list(os.scandir(root)):
                    delete_at(root, entry.name)
            finally:
                os.close(root)

        await in_pool(remove)

    async def clear(self) -> None:
        """Remove every key; the root directory stays."""
        await self.delete_dir("")

    # -- listing ----------------------------------------------------------------------------

    def _keys_below(
        self, folder: str, *, name: str | None = None
    ) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """The keys below the directory ``folder`` (``""``: the root) with their entries; no
        keys if it is missing or a file.

        Raises
        ------
        InvalidKeyError
            If ``folder`` is outside the root, naming ``name`` (``folder`` by default).
        """
        try:
            directory, real = self._open_directory(folder, name=folder if name is None else name)
        except MISSING:
            return
        try:
            yield from files_below(directory, real, f"{folder}/" if folder else "", self._boundary)
        finally:
            os.close(directory)

    def _key_list(self, folder: str, name: str | None = None) -> list[str]:
        return [key for key, _ in self._keys_below(folder, name=name)]

    async def list(self) -> AsyncIterator[str]:
        """Every key in the store."""
        for key in await in_pool(self._key_list, ""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        """Every key that starts with ``prefix`` (a string prefix: ``"fo"`` finds ``foo/a``).

        Raises
        ------
        InvalidKeyError
            If the directory ``prefix`` lies in would leave the root.
        """
        prefix = check_prefix(prefix)
        # The directory to walk, spelled as list() spells keys ("c//0" walks "c", and no key
        # starts with "c//").
        folder = "/".join(part for part in prefix.rpartition("/")[0].split("/") if part)
        for key in await in_pool(self._key_list, folder, prefix):
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        """The names of the keys and directories directly below ``prefix``; links that lead
        out of the root are none of them unless the store follows links.

        Raises
        ------
        InvalidKeyError
            If ``prefix`` would leave the root.
        """
        folder = check_prefix(prefix).rstrip("/")

        def names() -> list[str]:
            try:
                directory, real = self._open_directory(folder, name=prefix)
            except MISSING:
                return []
            try:
                with os.scandir(directory) as entries:
                    return [
                        entry.name
                        for entry in entries
                        if not _atomic.is_temporary(entry.name)
                        and (
                            not entry.is_symlink() or self._boundary.leads_inside(real, entry.name)
                        )
                    ]
            finally:
                os.close(directory)

        for name in await in_pool(names):
            yield name
