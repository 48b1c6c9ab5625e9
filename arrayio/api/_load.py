"""Loading: :func:`open` (lazy), :func:`load` (a whole file or some of its arrays) and
:func:`read_into` (into the caller's buffer), all through :class:`~arrayio.Reader`."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Sequence
from typing import Any

from ..arrays import _pytree
from ..arrays._frameworks import parse_target
from ..errors import FormatError, KeyNotFoundError, UnsupportedFormatError
from ..formats import shards
from ..runtime import _gcpause, _progress, _stages
from ._reader import Reader, _shardings_of, ahead_of_gpu_load, read_targets

__all__ = ["load", "open", "read_into"]

PathLike = str | os.PathLike[str]


def open(path: PathLike, *, verify: bool | None = None, tool: Any = None) -> Any:
    """Open a file lazily: its keys, dtypes, shapes and metadata, without reading data.

    Parameters
    ----------
    path
        An arrayio or safetensors container, or a ``.npy`` file (told apart by content).
    verify
        Check each whole array's CRC-32C as it is read (default: ``config`` setting, on).
    tool
        Force a transfer tool for this reader's reads (see :func:`save`).

    Returns
    -------
    Reader
        Use it as a context manager; ``reader.read(key, index=slice(1000, 2000))`` reads only
        those rows. For a checkpoint in several files (its ``*.safetensors.index.json`` or
        its directory), a :class:`~arrayio.ShardedReader` with the same ``keys``, ``read``
        and ``load``, opening each shard when first needed.

    Raises
    ------
    FormatError
        (and subclasses) for a damaged or hostile file, before any data is allocated.
    FileNotFoundError
        If ``path`` does not exist.
    """
    found = shards.find(path)
    if isinstance(found, shards.ShardIndex):
        from ._sharded_reader import ShardedReader

        return ShardedReader(found, verify=verify, tool=tool)
    return Reader(found if found is not None else path, verify=verify, tool=tool)


def _one_file(path: PathLike, what: str) -> PathLike:
    """``path``, or the single ``.safetensors`` file of the directory it names.

    Raises
    ------
    UnsupportedFormatError
        For a checkpoint in several files, which only :func:`load` reads.
    """
    found = shards.find(path)
    if isinstance(found, shards.ShardIndex):
        raise UnsupportedFormatError(
            f"{found.path}: a checkpoint in several files; {what} reads one file, "
            "arrayio.load reads them all"
        )
    return found if found is not None else path


def load(
    path: PathLike,
    *,
    like: Any = None,
    device: Any = None,
    keys: str | Sequence[str] | None = None,
    structure: Any = None,
    verify: bool | None = None,
    tool: Any = None,
    progress: bool | None = None,
    sharding: Any = None,
) -> Any:
    r"""Load what :func:`save` wrote (or any safetensors / ``.npy`` file, or a checkpoint in
    several safetensors files).

    Parameters
    ----------
    path
        The file; or a Hugging Face checkpoint in several files, by its
        ``*.safetensors.index.json`` or the directory holding it (a flat ``dict`` of its
        tensors comes back; ``keys`` opens only the shards that hold them). A directory
        holding a single ``.safetensors`` file loads that file.
    like
        The framework of the result: ``"numpy"``, ``"jax"``, ``"cupy"``, ``"torch"``, or an
        example array (whose device is also used when ``device`` is not given). Default: NumPy,
        or CuPy when ``device`` is a GPU, or the framework of a ``device`` object.
    device
        ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``jax.Device``, a ``torch.device``... Default:
        the CPU.
    keys
        Load only these arrays: the key of one array returns that array; a list returns a
        flat ``dict`` from key to array. A key naming a subtree (``"params"``) selects every
        array below it (alone, it also returns a flat ``dict``).
    structure
        An example pytree (arrays, ``jax.ShapeDtypeStruct`` or anything in their place) to
        rebuild, for custom JAX pytree classes that arrayio cannot rebuild on its own.
    verify
        Check CRC-32C checksums (default: on; ``ARRAYIO_VERIFY_CHECKSUMS=0`` turns it off).
    tool
        Force a transfer tool (see :func:`save`).
    progress
        Show a progress bar for long loads (see :func:`save`).
    sharding
        Global ``jax.Array``\ s with this ``jax.sharding.Sharding`` (or, for a mapping or a
        function, the one it gives for each key): each of this process's devices gets only
        its piece, read on its own (only the rows it covers), and the pieces are joined
        with ``jax.make_array_from_single_device_arrays``. Implies ``like="jax"``; no
        ``device``.

    Returns
    -------
    The saved structure with arrays of the requested framework on the requested device.

    Raises
    ------
    KeyNotFoundError, ChecksumError, FormatError, UnsupportedDtypeError, DeviceError
    """
    with _stages.calling("load"):  # where its time goes: arrayio.explain() shows the last
        return _load(path, like, device, keys, structure, verify, tool, progress, sharding)


def _load(
    path: PathLike,
    like: Any,
    device: Any,
    keys: str | Sequence[str] | None,
    structure: Any,
    verify: bool | None,
    tool: Any,
    progress: bool | None,
    sharding: Any,
) -> Any:
    with _stages.stage("open"):
        found = shards.find(path)
    if isinstance(found, shards.ShardIndex):
        if structure is None:
            return _load_shards(found, keys, like, device, verify, tool, progress, sharding)
        # The structure's keys name the tensors (a checkpoint in several files is flat);
        # placeholders that carry shardings place their arrays, as from one file.
        if keys is not None:
            raise UnsupportedFormatError("give structure= or keys=, not both")
        wanted = _pytree.example_keys(structure)
        if sharding is None and like in (None, "jax") and device is None:
            sharding = _shardings_of(structure)
        flat = _load_shards(found, wanted, like, device, verify, tool, progress, sharding)
        return _pytree.rebuild_like(structure, flat.__getitem__)
    with _stages.stage("open"):
        reader = Reader(found if found is not None else path, verify=verify, tool=tool)
    with reader:
        return reader.load(
            keys=keys,
            like=like,
            device=device,
            structure=structure,
            progress=progress,
            sharding=sharding,
        )


def _load_shards(
    index: shards.ShardIndex,
    keys: str | Sequence[str] | None,
    like: Any,
    device: Any,
    verify: bool | None,
    tool: Any,
    progress: bool | None,
    sharding: Any = None,
) -> Any:
    """The tensors ``keys`` selects from a checkpoint in several files, as one flat dict in
    the index's order (or the one array an exact key names); only the shards holding them
    are opened, and their arrays read as one batch (:func:`_one_batch`), or, where that
    cannot be (a sharding to place them by, results that finishing copies), file by
    file."""
    by_file = index.select(keys)
    if sharding is None and len(by_file) > 1:
        together = _one_batch(index, by_file, like, device, verify, tool, progress)
        if together is not None:
            return _in_order(index, by_file, keys, together)
    record = _stages.current()  # the shards' stages are the load's, on any thread

    def load_file(file: str, names: list[str]) -> dict[str, Any]:
        try:
            with _stages.joined(record), Reader(file, verify=verify, tool=tool) as reader:
                part = reader.load(
                    keys=names, like=like, device=device, progress=progress, sharding=sharding
                )
        except KeyNotFoundError as error:
            raise FormatError(
                f"{index.path}: the index places tensors in {os.path.basename(file)} that it "
                f"does not hold ({error})"
            ) from None
        return dict(part)

    workers = 1 if _all_in_the_page_cache(list(by_file)) else min(len(by_file), 8)
    if workers == 1:  # one after another: on the caller's thread, its CUDA stream current
        parts = [load_file(*item) for item in by_file.items()]
    else:
        with concurrent.futures.ThreadPoolExecutor(workers, "arrayio-shards") as pool:
            parts = list(pool.map(lambda item: load_file(*item), by_file.items()))
    loaded: dict[str, Any] = {}
    for part in parts:
        loaded.update(part)
    return _in_order(index, by_file, keys, loaded)


def _in_order(
    index: shards.ShardIndex,
    by_file: dict[str, list[str]],
    keys: str | Sequence[str] | None,
    loaded: dict[str, Any],
) -> Any:
    """The tensors ``loaded`` in the index's order (or the one an exact key names)."""
    ordered = {name: loaded[name] for names in by_file.values() for name in names}
    ordered = {name: ordered[name] for name in index.files if name in ordered}
    if isinstance(keys, str) and keys in index.files:
        return ordered[keys]
    return ordered


def _one_batch(
    index: shards.ShardIndex,
    by_file: dict[str, list[str]],
    like: Any,
    device: Any,
    verify: bool | None,
    tool: Any,
    progress: bool | None,
) -> dict[str, Any] | None:
    """The tensors of ``by_file`` (file: names), every file's read in one batch of the
    dispatcher's (``Dispatcher.read_many_files``): loading the shards one after another
    fills and drains the tool's pipeline, and waits for the GPU's checksums, once a file.
    None where the results' finishing copies them (host bytes put on a GPU by JAX without
    the driver's memory): those load file by file, in batches that bound the copies."""
    with _stages.stage("target"):  # (as a load of one file does)
        request = parse_target(like, device)
    with contextlib.ExitStack() as readers:
        batch = []
        with _stages.stage("open"):
            opened = {
                file: readers.enter_context(Reader(file, verify=verify, tool=tool))
                for file in by_file
            }
        for file, names in by_file.items():
            reader = opened[file]
            if len(names) == len(reader._stored) and set(names) == reader._stored.keys():
                # The index names every tensor of the file: all of them (the order is the
                # index's, restored by _in_order), without a lookup of each name's subtree.
                batch.append((reader, names))
                continue
            try:
                chosen = reader._select(names)
            except KeyNotFoundError as error:
                raise FormatError(
                    f"{index.path}: the index places tensors in {os.path.basename(file)} that "
                    f"it does not hold ({error})"
                ) from None
            batch.append((reader, chosen))
        total = sum(reader._stored[key].nbytes for reader, chosen in batch for key in chosen)
        verifies = any(reader._verifies(chosen) for reader, chosen in batch)
        with _stages.stage("target"):
            ahead_of_gpu_load(request, total, verifies)
        results: dict[str, Any] = {}
        with _gcpause.paused(across_transfers=True):
            targets = []
            for reader, chosen in batch:
                allocated = reader.allocated(chosen, request)
                if allocated is None:
                    return None
                targets += allocated
            with _progress.bar(total, desc=f"loading {index.path}", progress=progress) as advance:
                read_targets(targets, results, advance)
        return results


def _all_in_the_page_cache(files: Sequence[str]) -> bool:
    """Whether every file is wholly in the page cache. Then the shards load one after
    another: each load already has every thread its tool runs, and loads side by side only
    contend for them (a 4-file checkpoint read side by side ran at a third of one file's
    rate on a 2-core machine, one after another at the same). From the disk, several at
    once keep more requests in flight."""
    from ..dispatch.context import cache_state

    for file in files:
        try:
            fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return False  # the load says why
        try:
            if cache_state(fd, 0, os.fstat(fd).st_size) != "warm":
                return False
        finally:
            os.close(fd)
    return True


def read_into(
    path: PathLike,
    out: Any,
    *,
    key: str | None = None,
    verify: bool | None = None,
    tool: Any = None,
) -> Any:
    """Fill ``out``, an array the caller allocated (NumPy, CuPy or torch), in place.

    No second full-size buffer is allocated: bytes go from the file into ``out`` (through
    bounded pinned staging buffers for GPU memory).

    Parameters
    ----------
    path
        The file.
    out
        A contiguous, writable array of the stored dtype and shape.
    key
        Which array; may be omitted when the file holds one.
    verify
        Check the array's CRC-32C (default: on).
    tool
        Force a transfer tool (see :func:`save`).

    Returns
    -------
    ``out``

    Raises
    ------
    MismatchError
        If ``out``'s dtype or shape differ from the stored array's.
    UnsupportedObjectError
        For a JAX array (immutable) or a non-contiguous ``out``.
    """
    with Reader(_one_file(path, "arrayio.read_into"), verify=verify, tool=tool) as reader:
        return reader.read_into(out, key)
