"""Checkpoints in several safetensors files with a Hugging Face index: loaded whole, in part
(opening only the shards needed), by the index or its directory; hostile indexes refused
before any shard is opened."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrayio
from arrayio.errors import FormatError, KeyNotFoundError, UnsupportedFormatError
from arrayio.formats import shards

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def write_checkpoint(directory: Path, files: int = 3) -> dict[str, np.ndarray]:
    """A Hugging Face-style checkpoint: ``model-0000i-of-0000n.safetensors`` and its index,
    the shards written by safetensors itself."""
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray] = {"model.embed.weight": rng.standard_normal((8, 4))}
    for layer in range(4):
        tensors[f"model.layers.{layer}.w"] = rng.standard_normal((4, 4)).astype(np.float32)
        tensors[f"model.layers.{layer}.norm"] = np.ones(4, np.float16)
    tensors["lm_head.weight"] = rng.standard_normal((8, 4)).astype(np.float32)
    names = list(tensors)
    weight_map = {}
    for i in range(files):
        part = names[i::files]
        file_name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        safetensors_numpy.save_file({n: tensors[n] for n in part}, directory / file_name)
        weight_map.update(dict.fromkeys(part, file_name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}}
    index["weight_map"] = {name: weight_map[name] for name in names}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def same(loaded: dict, expected: dict) -> None:
    assert list(loaded) == list(expected)
    for name, array in expected.items():
        assert loaded[name].dtype == array.dtype and np.array_equal(loaded[name], array), name


def test_a_checkpoint_loads_by_its_directory_or_its_index(tmp_path):
    tensors = write_checkpoint(tmp_path)
    same(arrayio.load(tmp_path), tensors)
    same(arrayio.load(tmp_path / "model.safetensors.index.json"), tensors)


def test_keys_open_only_the_shards_that_hold_them(tmp_path, monkeypatch):
    tensors = write_checkpoint(tmp_path)
    opened: list[str] = []
    real = arrayio.api._reader.Reader.__init__

    def recording(self, path, **kwargs):
        opened.append(Path(path).name)
        real(self, path, **kwargs)

    monkeypatch.setattr(arrayio.api._reader.Reader, "__init__", recording)
    layer = arrayio.load(tmp_path, keys="model.layers.1")  # a subtree: a flat dict
    same(layer, {n: t for n, t in tensors.items() if n.startswith("model.layers.1.")})
    index = shards.find(tmp_path)
    assert sorted(opened) == sorted({Path(index.files[n]).name for n in layer})
    one = arrayio.load(tmp_path, keys="lm_head.weight")  # one exact name: the array
    assert np.array_equal(one, tensors["lm_head.weight"])
    both = arrayio.load(tmp_path, keys=["lm_head.weight", "model.embed.weight"])
    assert list(both) == ["model.embed.weight", "lm_head.weight"]  # the index's order
    with pytest.raises(KeyNotFoundError):
        arrayio.load(tmp_path, keys="model.layers.9")


def test_a_directory_of_one_file_loads_it_and_open_reads_one_file(tmp_path):
    tensors = {"a": np.arange(3.0)}
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    same(arrayio.load(tmp_path), tensors)
    with arrayio.open(tmp_path) as reader:
        assert list(reader.keys()) == ["a"]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    saved = write_checkpoint(sharded)
    with pytest.raises(UnsupportedFormatError, match="arrayio.load reads them all"):
        arrayio.read_into(sharded, np.empty(1))
    # A structure names the tensors it wants, from whichever files hold them.
    example = {"lm_head.weight": 0, "model.layers.0.w": 0}
    got = arrayio.load(sharded, structure=example)
    assert set(got) == set(example)
    for key in example:
        np.testing.assert_array_equal(got[key], saved[key])
    with pytest.raises(KeyNotFoundError):
        arrayio.load(sharded, structure={"a": 0})


def test_ambiguous_directories_are_refused_with_the_reason(tmp_path):
    for name in ("a.safetensors", "b.safetensors"):
        safetensors_numpy.save_file({"x": np.zeros(1)}, tmp_path / name)
    with pytest.raises(UnsupportedFormatError, match="no \\*.safetensors.index.json"):
        arrayio.load(tmp_path)
    for name in ("a", "b"):
        (tmp_path / f"{name}.safetensors.index.json").write_text("{}")
    with pytest.raises(UnsupportedFormatError, match="several checkpoint indexes"):
        arrayio.load(tmp_path)


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "weight_map"),
        ('{"weight_map": {}}', "weight_map"),
        ('{"weight_map": {"a": "../outside.safetensors"}}', "plain file names"),
        ('{"weight_map": {"a": "/etc/passwd"}}', "plain file names"),
        ('{"weight_map": {"a": "missing.safetensors"}}', "not there"),
        ('{"weight_map": {"a": 3}}', "map names to file names"),
        ('{"weight_map": {"a": "model-00001-of-00003.safetensors"}, "metadata": 1}', "metadata"),
        ("[" * 100000 + "]" * 100000, "not JSON"),
    ],
)
def test_hostile_indexes_are_refused_before_any_shard_opens(tmp_path, index, message):
    write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(FormatError, match=message):
        arrayio.load(tmp_path)


def test_an_index_too_large_is_refused_before_it_is_read(tmp_path, monkeypatch):
    write_checkpoint(tmp_path)
    monkeypatch.setattr(shards, "MAX_INDEX_BYTES", 64)
    with pytest.raises(FormatError, match="over the 64"):
        arrayio.load(tmp_path)


def test_an_index_that_misplaces_a_tensor_is_a_format_error(tmp_path):
    write_checkpoint(tmp_path)
    path = tmp_path / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00003.safetensors"  # not there
    path.write_text(json.dumps(index))
    with pytest.raises(FormatError, match="does not hold"):
        arrayio.load(tmp_path)


@pytest.mark.parametrize("change", ["renamed", "left_out"])
def test_an_index_unlike_its_shards_loads_what_it_names_or_refuses(tmp_path, change):
    # Where the index names every tensor of a shard, the shard's tensors are read without
    # a lookup of each name; an index that names a tensor its shard lacks (as many names as
    # the shard holds) is refused, and one that leaves a tensor out loads the others.
    tensors = write_checkpoint(tmp_path)
    path = tmp_path / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    file_of = index["weight_map"].pop("model.layers.0.w")
    if change == "renamed":
        index["weight_map"]["model.layers.0.v"] = file_of  # not in the shard
        path.write_text(json.dumps(index))
        with pytest.raises(FormatError, match="does not hold"):
            arrayio.load(tmp_path)
    else:
        path.write_text(json.dumps(index))
        del tensors["model.layers.0.w"]
        same(arrayio.load(tmp_path), tensors)


# -- writing them --------------------------------------------------------------------------------


def state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state = {"model.embed.weight": rng.standard_normal((64, 32)).astype(np.float32)}  # 8 KiB
    for layer in range(6):
        state[f"model.layers.{layer}.w"] = rng.standard_normal((16, 32)).astype(np.float32)
        state[f"model.layers.{layer}.norm"] = np.ones(32, np.float16)
    return state


def files_of(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_a_sharded_save_writes_hugging_face_files_that_load_back(tmp_path):
    from arrayio.api._save_shards import shard_groups

    state = state_dict()
    arrayio.save(tmp_path, state, max_shard_size=4096)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    sizes = [a.nbytes for a in state.values()]
    groups = shard_groups(sizes, 4096)
    count = len(groups)
    assert count > 2
    assert files_of(tmp_path) == sorted(
        [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        + ["model.safetensors.index.json"]
    )
    assert index["metadata"]["total_size"] == sum(sizes)
    assert list(index["weight_map"]) == list(state)
    for file_name in set(index["weight_map"].values()):  # safetensors reads each shard
        with safetensors_numpy.safe_open(tmp_path / file_name, framework="np") as shard:
            assert shard.metadata()["format"] == "pt"  # or transformers refuses the file
        part = safetensors_numpy.load_file(tmp_path / file_name)
        for name, array in part.items():
            assert index["weight_map"][name] == file_name and np.array_equal(array, state[name])
    same(arrayio.load(tmp_path), state)


def test_shards_are_cut_as_transformers_cuts_them():
    from arrayio.api._save_shards import shard_groups

    assert shard_groups([3, 3, 3, 3], 6) == [[0, 1], [2, 3]]
    assert shard_groups([2, 9, 2, 2], 5) == [[0], [1], [2, 3]]  # too large: a shard alone
    assert shard_groups([1, 1, 1], 100) == [[0, 1, 2]]


def test_a_new_sharded_save_replaces_the_old_one_whole(tmp_path):
    arrayio.save(tmp_path, state_dict(0), max_shard_size=4096)
    (tmp_path / "config.json").write_text("{}")  # what else lives beside a checkpoint stays
    first = files_of(tmp_path)
    arrayio.save(tmp_path, state_dict(1), max_shard_size=4096)
    second = files_of(tmp_path)
    assert "config.json" in second
    shards_now = set(
        json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values()
    )
    assert not shards_now & set(first)  # the same count: new names, so no index ever mixes
    assert set(second) == shards_now | {"model.safetensors.index.json", "config.json"}
    same(arrayio.load(tmp_path), state_dict(1))
    arrayio.save(tmp_path, state_dict(2), max_shard_size=4096)  # the standard names again
    same(arrayio.load(tmp_path), state_dict(2))
    assert len(files_of(tmp_path)) == len(first)


def test_an_interrupted_sharded_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    from arrayio.integrity import _atomic

    arrayio.save(tmp_path, state_dict(0), max_shard_size=4096)
    real = _atomic.atomic_write

    def failing(path, **kwargs):
        if str(path).endswith(".index.json"):
            raise OSError("disk went away")
        return real(path, **kwargs)

    monkeypatch.setattr(_atomic, "atomic_write", failing)
    with pytest.raises(OSError, match="went away"):
        arrayio.save(tmp_path, state_dict(1), max_shard_size=4096)
    same(arrayio.load(tmp_path), state_dict(0))  # the old index, the old shards
    monkeypatch.setattr(_atomic, "atomic_write", real)
    arrayio.save(tmp_path, state_dict(2), max_shard_size=4096)  # and the next save tidies up
    same(arrayio.load(tmp_path), state_dict(2))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(files_of(tmp_path)) == set(index["weight_map"].values()) | {
        "model.safetensors.index.json"
    }


def test_one_shard_is_a_single_file_and_retires_an_old_index(tmp_path):
    arrayio.save(tmp_path / "model.safetensors", state_dict(0), max_shard_size=4096)
    arrayio.save(tmp_path / "model.safetensors", state_dict(1), max_shard_size="1G")
    assert files_of(tmp_path) == ["model.safetensors"]
    same(arrayio.load(tmp_path), state_dict(1))


def test_sharded_saves_refuse_what_they_cannot_write(tmp_path):
    with pytest.raises(ValueError, match="max_shard_size"):
        arrayio.save(tmp_path, state_dict(), max_shard_size=0)
    with pytest.raises(UnsupportedFormatError):
        arrayio.save(tmp_path / "x.npz", state_dict(), max_shard_size=4096)


def test_open_reads_a_checkpoint_in_several_files_one_shard_at_a_time(tmp_path):
    tensors = write_checkpoint(tmp_path)
    index = shards.find(tmp_path)
    with arrayio.open(tmp_path) as reader:
        assert reader.keys() == list(tensors) and len(reader) == len(tensors)
        assert "lm_head.weight" in reader and "nothing" not in reader
        assert reader.metadata["total_size"] == sum(t.nbytes for t in tensors.values())
        assert reader["model.embed.weight"].shape == (8, 4)
        assert len(reader._open) == 1  # only the shard that holds it
        rows = reader.read("model.embed.weight", slice(2, 5))  # a tensor-parallel slice
        np.testing.assert_array_equal(rows, tensors["model.embed.weight"][2:5])
        same(
            reader.load(keys="model.layers.2"),
            {n: t for n, t in tensors.items() if n.startswith("model.layers.2.")},
        )
        with pytest.raises(KeyNotFoundError):
            reader.read("nothing")
        opened = list(reader._open.values())
        assert "tensors in 3 files" in repr(reader)
        assert len(set(index.files.values())) == 3
    assert all(r.closed for r in opened)
    # The index itself opens the same checkpoint, as transformers names it.
    with arrayio.open(tmp_path / f"model{shards.INDEX_SUFFIX}") as reader:
        assert reader.keys() == list(tensors)
        np.testing.assert_array_equal(reader.read("lm_head.weight"), tensors["lm_head.weight"])


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_a_checkpoint_s_shards_load_as_one_batch_on_the_caller_s_thread(
    tmp_path, monkeypatch, cache
):
    # Every file's arrays in one batch of the dispatcher's, from the page cache or the disk:
    # no file loaded after another (each filling and draining the tool's pipeline), and on
    # the caller's thread (a GPU load waits for the caller's own current CUDA stream).
    import threading

    from arrayio.api import _load
    from arrayio.dispatch import context
    from arrayio.dispatch.dispatcher import Dispatcher

    tensors = write_checkpoint(tmp_path, files=3)
    monkeypatch.setattr(context, "cache_state", lambda fd, offset, nbytes: cache)
    batches, per_file = [], []
    real = Dispatcher.read_many_files

    def read_many_files(self, requests, **kwargs):
        batches.append((threading.current_thread(), {fd for fd, _, _ in requests}))
        return real(self, requests, **kwargs)

    monkeypatch.setattr(Dispatcher, "read_many_files", read_many_files)
    monkeypatch.setattr(_load.Reader, "load", lambda self, **kwargs: per_file.append(self))
    same(arrayio.load(tmp_path), tensors)
    [(thread, files)] = batches
    assert thread is threading.current_thread() and len(files) == 3 and per_file == []
    assert _stages_of_last_load() >= {"open", "allocate", "transfers", "finish"}


def _stages_of_last_load() -> set[str]:
    from arrayio.runtime import _stages

    last = _stages.last()
    return set(last["stages"]) if last else set()


def test_shards_whose_results_copy_load_file_by_file(tmp_path, monkeypatch):
    # Results that finishing copies (JAX on the CPU, given bfloat16 bytes) load file by file,
    # in batches that bound the copies, with the same results.
    jax = pytest.importorskip("jax")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from arrayio.api import _load

    values = {
        f"w{i}": np.arange(64 * 1024, dtype=np.float32).astype(ml_dtypes.bfloat16) + i
        for i in range(4)
    }
    arrayio.save(tmp_path / "ckpt", values, max_shard_size="160K")
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) > 1
    per_file = []
    real = _load.Reader.load

    def load(self, **kwargs):
        per_file.append(self.path)
        return real(self, **kwargs)

    monkeypatch.setattr(_load.Reader, "load", load)
    back = arrayio.load(tmp_path / "ckpt", like="jax")
    assert len(per_file) > 1
    for key, value in values.items():
        assert isinstance(back[key], jax.Array)
        np.testing.assert_array_equal(np.asarray(back[key]), value)


def test_a_shard_whose_arrays_are_all_inflated_does_not_lend_its_file(tmp_path):
    # The index may place arrays in a compressed .npz (inflated one by one, not moved by a
    # tool) beside a safetensors shard: the shard's arrays are read from the shard's file.
    x = np.random.default_rng(1).standard_normal(1_000_000).astype(np.float32)
    y = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    np.savez_compressed(tmp_path / "a.npz", x=x)
    arrayio.save(tmp_path / "b.safetensors", {"y": y})
    index = {"weight_map": {"x": "a.npz", "y": "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for verify in (False, True):
        out = arrayio.load(tmp_path, verify=verify)
        np.testing.assert_array_equal(out["x"], x)
        np.testing.assert_array_equal(out["y"], y)


def test_each_shard_is_checked_against_memory_as_its_own_load(tmp_path, monkeypatch):
    # As when the shards loaded one by one: each is refused where it alone would not fit,
    # and the refusal names a file that is too large, never a healthy one.
    from arrayio.api import _reader

    for n in range(2):  # 72 MB each: above the size from which loads are checked
        arrayio.save(tmp_path / f"m-{n}.safetensors", {f"w{n}": np.ones(18_000_000, np.float32)})
    weight_map = {f"w{n}": f"m-{n}.safetensors" for n in range(2)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    monkeypatch.setattr(_reader._memory, "available_host_bytes", lambda *a, **k: 100 << 20)
    out = arrayio.load(tmp_path)
    assert sorted(out) == ["w0", "w1"]
    monkeypatch.setattr(_reader._memory, "available_host_bytes", lambda *a, **k: 50 << 20)
    with pytest.raises(arrayio.errors.OutOfMemoryError, match="m-0.safetensors: loading needs"):
        arrayio.load(tmp_path)


def _select_by_scanning(files: dict[str, str], keys: list[str]) -> dict[str, list[str]] | None:
    """What an index's select() gives, by its definition: each key's tensors (itself, and
    those below it after a "." or a "/") in the index's order, grouped by file, without
    repeats (None where a key names nothing)."""
    wanted: list[str] = []
    for key in keys:
        below = [n for n in files if n == key or n.startswith((f"{key}.", f"{key}/"))]
        if not below:
            return None
        wanted += below
    by_file: dict[str, list[str]] = {}
    for name in dict.fromkeys(wanted):
        by_file.setdefault(files[name], []).append(name)
    return by_file


_NAME = st.text(alphabet="ab./-_", min_size=1, max_size=4)


@settings(max_examples=80, deadline=None)
@given(names=st.lists(_NAME, min_size=1, max_size=12, unique=True), data=st.data())
def test_select_gives_what_its_definition_says(names, data):
    # The names are looked up in sorted order (a rank's hundreds of keys each scanned
    # against every name took a quadratic time): the same tensors, grouped and ordered the
    # same, for names around "." and "/" in sort order and names that are also prefixes.
    shuffled = data.draw(st.permutations(names))  # the index's order, not sorted
    files = {name: f"shard-{i % 3}" for i, name in enumerate(shuffled)}
    index = shards.ShardIndex("index.json", files, {})
    keys = data.draw(st.lists(st.one_of(st.sampled_from(names), _NAME), min_size=1, max_size=5))
    expected = _select_by_scanning(files, keys)
    if expected is None:
        with pytest.raises(KeyNotFoundError):
            index.select(keys)
    else:
        chosen = index.select(keys)
        assert chosen == expected and list(chosen) == list(expected)
