"""The dispatcher wired into arrayio's public API, on real files.

A tool that fails is dropped and the call falls back with the data intact; a damaged file is
a data error, never a reason to drop a tool; ``tool=``, ``config.set(tool=...)`` and
``ARRAYIO_TOOL`` force one arm; what is learned outlives the process; threads share one
dispatcher; and a file system that refuses ``O_DIRECT`` costs one failed call per context.

Tests that need a clean dispatcher install a fresh in-memory one and put the process-wide one
back afterwards (``dispatcher.reset()``); fake tools are registered in a copy of the registry.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import crc32c
import numpy as np
import pytest

import arrayio
from arrayio import tools
from arrayio.dispatch import Arm, dispatcher
from arrayio.dispatch.dispatcher import SMALL_TRANSFER, parse_arm
from arrayio.errors import ToolUnavailableError, TruncatedFileError, UnknownToolError
from arrayio.tools import Capabilities, IOFuture, Tool
from arrayio.tools import direct as direct_module
from arrayio.tools._io import pread_full, pwrite_full
from benchmarks import _pagecache as pagecache

MiB = 1 << 20
GARBAGE = 0xA5


# ---- fixtures and helpers ----------------------------------------------------------------


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a test register tools without leaking them into other tests."""
    monkeypatch.setattr(tools, "_REGISTRY", dict(tools._REGISTRY))


@pytest.fixture
def prepend(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Put arms before the built-in candidates of every context (for dispatchers made after)."""

    def install(*arms: Arm) -> None:
        builtin = dispatcher.candidate_arms
        monkeypatch.setattr(
            dispatcher, "candidate_arms", lambda context: [*arms, *builtin(context)]
        )

    return install


def make_scribbler(error: Callable[[], BaseException]) -> tuple[type[Tool], Counter[str]]:
    """A tool that scribbles garbage where the data goes, then fails with ``error()``."""
    calls: Counter[str] = Counter()

    class Scribbler(Tool):
        name = "scribbler"
        capabilities = Capabilities(frozenset({"host"}))

        def pread(self, fd, buffer, file_offset, *, checksum=None):
            calls["read"] += 1
            buffer[...] = GARBAGE
            if checksum is not None:
                checksum.add_data(0, buffer)
            raise error()

        def pwrite(self, fd, buffer, file_offset, *, checksum=None):
            calls["write"] += 1
            garbage = np.full(buffer.nbytes, GARBAGE, dtype=np.uint8)
            pwrite_full(fd, garbage, file_offset)
            if checksum is not None:
                checksum.add_data(0, garbage)
            raise error()

    return Scribbler, calls


class NoChecksums(Tool):
    """Plain pread/pwrite that cannot report checksums; records what it was handed."""

    name = "nocrc"
    capabilities = Capabilities(frozenset({"host"}), checksums=False)
    handed: list[object] = []

    def pread(self, fd, buffer, file_offset, *, checksum=None):
        self.handed.append(checksum)
        return IOFuture.completed(pread_full(fd, buffer, file_offset))

    def pwrite(self, fd, buffer, file_offset, *, checksum=None):
        self.handed.append(checksum)
        return IOFuture.completed(pwrite_full(fd, buffer, file_offset))


def random_tree(seed: int, sizes: dict[str, int]) -> dict[str, np.ndarray]:
    """Arrays of the given byte sizes, of mixed dtypes, from arbitrary bytes."""
    rng = np.random.default_rng(seed)
    dtypes = [np.float32, np.uint8, np.int16, np.float64]
    tree = {}
    for i, (key, nbytes) in enumerate(sizes.items()):
        dtype = np.dtype(dtypes[i % len(dtypes)])
        tree[key] = rng.integers(0, 256, nbytes - nbytes % dtype.itemsize, dtype=np.uint8).view(
            dtype
        )
    return tree


def assert_same(loaded: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert loaded.keys() == expected.keys()
    for key, array in expected.items():
        assert loaded[key].dtype == array.dtype and loaded[key].shape == array.shape, key
        assert loaded[key].tobytes() == array.tobytes(), key


def assert_checksums_recorded(path: Path, expected: dict[str, np.ndarray]) -> None:
    with arrayio.open(path) as reader:
        for key, array in expected.items():
            assert reader[key].crc32c == f"{crc32c.crc32c(array.tobytes()):08x}", key


def evict(path: Path) -> None:
    """Push the file's pages out of the page cache (no root needed)."""
    pagecache.evict(os.fspath(path))


def warm(path: Path) -> None:
    """Bring the whole file into the page cache."""
    path.read_bytes()


def contexts_of(report: arrayio.DispatchReport) -> dict[str, dict]:
    return {context["key"]: context for context in report.as_dict()["contexts"]}


def reason_of(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def python(
    code: str, *args: str, env: dict[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with ``env`` over a clean ARRAYIO_* environment."""
    base = {name: value for name, value in os.environ.items() if not name.startswith("ARRAYIO_")}
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code), *args],
        env={**base, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def run_python(code: str, *args: str, env: dict[str, str], cwd: Path) -> str:
    """:func:`python`, which must succeed; its standard output."""
    result = python(code, *args, env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr
    # An error in an atexit hook (the dispatcher saves its table there) does not change the
    # exit status.
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, (
        result.stderr
    )
    return result.stdout


# ---- a failing tool falls back ----------------------------------------------------------


FAILURES = {
    "ToolUnavailableError": lambda: ToolUnavailableError("scribbler: the device went away"),
    "EINVAL": lambda: OSError(errno.EINVAL, "Invalid argument"),
    "RuntimeError": lambda: RuntimeError("scribbler: CUDA error 700"),
}


@pytest.mark.parametrize("error", FAILURES.values(), ids=FAILURES.keys())
def test_a_tool_that_fails_after_scribbling_falls_back_with_exact_data(
    tmp_path, registry, prepend, fresh, error
):
    scribbler, calls = make_scribbler(error)
    tools.register("scribbler", scribbler, clobber=True)
    prepend(Arm("scribbler"))
    # Saves and loads move their three large arrays as one batch (9 MiB: 2^24), read_into
    # one array (2^22); the small array takes the small-transfer path and never meets the
    # scribbler.
    sizes = {"a": 4 * MiB, "b": MiB + 12345, "c": 4 * MiB - 8, "small": 1000}
    tree = random_tree(1, sizes)
    first = tmp_path / "first.safetensors"
    arrayio.save(first, tree)
    assert calls["write"] >= 1
    assert_same(arrayio.load(first), tree)
    assert calls["read"] >= 1
    assert_checksums_recorded(first, tree)
    out = np.empty_like(tree["a"])
    assert arrayio.read_into(first, out, key="a") is out
    assert out.tobytes() == tree["a"].tobytes()

    report = arrayio.explain()
    contexts = contexts_of(report)
    marked = {
        key: context for key, context in contexts.items() if "scribbler" in context["unavailable"]
    }
    # Tried once in each learned context, never again there.
    assert sum(calls.values()) == len(marked)
    assert {key.split("/")[0] for key in marked} == {"read", "write"}
    assert {key.split("/")[2] for key in marked} == {"2^22", "2^24"}
    expected = reason_of(error())
    for context in marked.values():
        assert context["unavailable"]["scribbler"] == expected
        [arm] = [arm for arm in context["arms"] if arm["label"] == "scribbler"]
        assert (arm["state"], arm["failures"], arm["reason"]) == ("unavailable", 1, expected)
        assert context["chosen"] != "scribbler"
    lines = [line for line in str(report).splitlines() if line.lstrip().startswith("scribbler ")]
    assert len(lines) == len(marked)
    assert all("unavailable" in line and expected in line for line in lines)
    json.dumps(report.as_dict(), allow_nan=False)

    # Later transfers do not try it again in those contexts. (They may meet new ones: a
    # file written with O_DIRECT is read back cold.)
    second = tmp_path / "second.safetensors"
    for _ in range(3):
        arrayio.save(second, tree)
        assert_same(arrayio.load(second), tree)
    assert_checksums_recorded(second, tree)
    later = {
        key: context
        for key, context in contexts_of(arrayio.explain()).items()
        if "scribbler" in context["unavailable"]
    }
    assert later.keys() >= marked.keys()
    assert sum(calls.values()) == len(later)
    for context in later.values():
        [arm] = [arm for arm in context["arms"] if arm["label"] == "scribbler"]
        assert (arm["failures"], arm["count"]) == (1, 0)


class _QueuedDevice:
    """Host bytes posing as GPU memory whose writes a tool may queue, as on a stream of its
    own: they land when the GPU is synchronized (``finish``), not when queued."""

    device_index = 0

    def __init__(self, data: np.ndarray, queue: list[Callable[[], None]]) -> None:
        self.data, self.queue, self.nbytes = data, queue, data.nbytes

    def part(self, start: int, stop: int) -> _QueuedDevice:
        return _QueuedDevice(self.data[start:stop], self.queue)

    def finish(self) -> None:
        while self.queue:
            self.queue.pop(0)()


def test_a_failed_tools_queued_device_writes_land_before_the_next_tool_reads(
    tmp_path, registry, monkeypatch
):
    # The first tool queues garbage into the device buffer on its stream, then fails; the
    # next reads the file's bytes. Unless the GPU is synchronized before the next tool
    # runs, the garbage lands after the good bytes, and the read returns it, silently.
    queue: list[Callable[[], None]] = []

    class QueuesThenFails(Tool):
        name = "queues-then-fails"
        capabilities = Capabilities(frozenset({"cuda"}), checksums=False)

        def pread(self, fd, buffer, file_offset, *, checksum=None):
            queue.append(lambda: buffer.data.fill(GARBAGE))
            raise ToolUnavailableError("queues-then-fails: injected")

        pwrite = pread

    class Reads(Tool):
        name = "reads"
        capabilities = Capabilities(frozenset({"cuda"}), checksums=False)

        def pread(self, fd, buffer, file_offset, *, checksum=None):
            host = np.empty(buffer.nbytes, np.uint8)
            n = pread_full(fd, host, file_offset)
            buffer.data[:] = host
            return IOFuture.completed(n)

        pwrite = pread

    tools.register("queues-then-fails", QueuesThenFails, clobber=True)
    tools.register("reads", Reads, clobber=True)
    arms = [Arm("queues-then-fails"), Arm("reads")]
    monkeypatch.setattr(dispatcher, "candidate_arms", lambda context: list(arms))
    monkeypatch.setattr(dispatcher, "synchronize_device", lambda buffer: buffer.finish())
    data = np.random.default_rng(3).integers(0, 256, 4 * MiB, dtype=np.uint8)
    path = tmp_path / "data.bin"
    path.write_bytes(data.tobytes())
    active = dispatcher.Dispatcher(None)
    device = _QueuedDevice(np.zeros(4 * MiB, np.uint8), queue)
    fd = os.open(path, os.O_RDONLY)
    try:
        active.read(fd, device, 0, path=str(path))
    finally:
        os.close(fd)
        active.close()
    device.finish()  # whatever is still queued lands, as it would before the user's next use
    assert np.array_equal(device.data, data)


def test_a_forced_tool_that_fails_raises_without_fallback_or_mark(tmp_path, registry, fresh):
    scribbler, calls = make_scribbler(lambda: RuntimeError("scribbler: CUDA error 700"))
    tools.register("scribbler", scribbler, clobber=True)
    tree = random_tree(2, {"w": 2 * MiB})
    path = tmp_path / "w.safetensors"
    arrayio.save(path, tree)
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        arrayio.load(path, tool="scribbler")
    assert calls == {"read": 1}
    with pytest.raises(RuntimeError, match="CUDA error 700"):
        arrayio.save(tmp_path / "other.safetensors", tree, tool="scribbler")
    assert calls == {"read": 1, "write": 1}
    assert not (tmp_path / "other.safetensors").exists()
    assert all(context["unavailable"] == {} for context in contexts_of(arrayio.explain()).values())
    assert_same(arrayio.load(path), tree)  # the file is intact


def test_mmap_forced_for_a_save_raises_and_leaves_no_file(tmp_path, fresh):
    path = tmp_path / "w.safetensors"
    with arrayio.config.set(tool="mmap"), pytest.raises(ToolUnavailableError, match="reads only"):
        arrayio.save(path, random_tree(3, {"w": 2 * MiB}))
    assert list(tmp_path.iterdir()) == []


# ---- data errors are not tool failures ---------------------------------------------------


@pytest.mark.parametrize(
    "tool",
    [
        None,
        "naive",
        "posix(threads=2,task_size=1048576)",
        "direct(threads=2,task_size=1048576)",
        "mmap(threads=2)",
    ],
)
def test_a_truncated_file_is_a_data_error_not_a_fallback(tmp_path, fresh, tool):
    tree = random_tree(4, {"w": 4 * MiB})
    path = tmp_path / "w.safetensors"
    arrayio.save(path, tree)
    with arrayio.open(path, tool=tool) as reader:
        info = reader["w"]
        # Truncated after the header was checked: only the transfer can notice.
        os.truncate(path, info.file_offset + info.nbytes - MiB - 100)
        for _ in range(3):
            with pytest.raises(TruncatedFileError, match="short of the array"):
                reader.read("w")
    assert fresh.last[0].direction == "write"  # no read completed
    report = arrayio.explain()
    for context in contexts_of(report).values():
        assert context["unavailable"] == {}
        assert all(arm["failures"] == 0 for arm in context["arms"])
    # Opened afresh, the header check already refuses it.
    with pytest.raises(TruncatedFileError):
        arrayio.load(path, tool=tool)


# ---- forcing ------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [64 << 10, 2 * MiB], ids=["64KiB", "2MiB"])
def test_the_tool_argument_forces_the_arm_at_any_size(tmp_path, fresh, nbytes):
    tree = random_tree(5, {"w": nbytes})
    path = tmp_path / "w.safetensors"
    arrayio.save(path, tree, tool="naive")
    context, arm = dispatcher.get().last
    assert arm.label == "naive"
    assert context is not None and context.direction == "write"  # forced: through the policy

    assert_same(arrayio.load(path, tool="posix(threads=2,task_size=1048576)"), tree)
    context, arm = dispatcher.get().last
    assert arm.label == "posix(task_size=1048576,threads=2)"
    assert context is not None and context.direction == "read"

    out = np.empty_like(tree["w"])
    arrayio.read_into(path, out, tool=parse_arm("mmap(threads=1)"))
    assert dispatcher.get().last[1].label == "mmap(threads=1)"
    assert out.tobytes() == tree["w"].tobytes()

    posix = tools.make("posix", threads=3, task_size=MiB)
    try:
        with arrayio.open(path, tool=posix) as reader:
            assert reader.read("w").tobytes() == tree["w"].tobytes()
    finally:
        posix.close()
    assert dispatcher.get().last[1].label == "posix(task_size=1048576,threads=3)"

    assert all(e.phase != "forced" for e in arrayio.explain(path).explanations)
    arrayio.load(path)
    context, arm = dispatcher.get().last
    if nbytes < SMALL_TRANSFER:  # unforced small transfers skip the policy
        assert (context, arm.label) == (None, "naive")
    else:
        assert context is not None


def test_config_tool_forces_inside_the_with_block_only(tmp_path, fresh):
    tree = random_tree(6, {"w": 64 << 10, "v": 2 * MiB})
    path = tmp_path / "w.safetensors"
    arrayio.save(path, tree)
    with arrayio.config.set(tool="mmap"):
        assert_same(arrayio.load(path), tree)
        context, arm = dispatcher.get().last
        assert context is not None and arm.label == "mmap"
        report = arrayio.explain(path)  # forced, both arrays move in one batch
        assert [(e.phase, e.chosen) for e in report.explanations] == [("forced", "mmap")]
        assert report.explanations[0].key == context.key()
        # The argument wins over the setting.
        arrayio.load(path, tool="naive")
        assert dispatcher.get().last[1].label == "naive"
    assert arrayio.config.get().tool is None
    arrayio.load(path, keys="w")
    assert dispatcher.get().last == (None, Arm("naive"))
    assert all(e.phase != "forced" for e in arrayio.explain(path).explanations)


def test_arrayio_tool_forces_every_transfer_of_a_process(tmp_path):
    code = """
        import json, sys
        import numpy as np
        import arrayio
        from arrayio.dispatch import dispatcher

        path = sys.argv[1]
        arrayio.save(path, {"x": np.arange(1000, dtype=np.int32)})
        saved = dispatcher.get().last
        loaded = arrayio.load(path)["x"]
        assert np.array_equal(loaded, np.arange(1000, dtype=np.int32))
        read = dispatcher.get().last
        print(json.dumps({
            "labels": [saved[1].label, read[1].label],
            "directions": [saved[0].direction, read[0].direction],
            "explain": [[e.phase, e.chosen] for e in arrayio.explain(path).explanations],
        }))
    """
    env = {"ARRAYIO_TOOL": " posix( threads = 2 , task_size=65536 ) ", "ARRAYIO_CACHE_DIR": "none"}
    out = json.loads(run_python(code, str(tmp_path / "x.safetensors"), env=env, cwd=tmp_path))
    label = "posix(task_size=65536,threads=2)"
    assert out == {
        "labels": [label, label],
        "directions": ["write", "read"],
        "explain": [["forced", label]],
    }


def test_arrayio_tool_naming_an_unknown_tool_fails_the_transfer(tmp_path):
    code = """
        import numpy as np
        import arrayio
        arrayio.save("x.safetensors", {"x": np.arange(10)})
    """
    result = python(code, env={"ARRAYIO_TOOL": "nope", "ARRAYIO_CACHE_DIR": "none"}, cwd=tmp_path)
    assert result.returncode != 0
    assert "UnknownToolError: no transfer tool named 'nope'" in result.stderr
    assert list(tmp_path.iterdir()) == []  # not even a temporary file


def test_an_unknown_tool_name_raises_with_the_known_ones(tmp_path, fresh):
    tree = random_tree(7, {"w": 2 * MiB})
    path = tmp_path / "w.safetensors"
    arrayio.save(path, tree)
    with pytest.raises(UnknownToolError, match=r"no transfer tool named 'nope'.*posix") as raised:
        arrayio.load(path, tool="nope")
    assert isinstance(raised.value, KeyError)
    assert all(f"'{name}'" in str(raised.value) for name in ("naive", "posix", "direct", "mmap"))
    with pytest.raises(UnknownToolError, match="'nope'"):
        arrayio.save(tmp_path / "other.safetensors", tree, tool="nope(threads=2)")
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]
    with arrayio.config.set(tool="nope"), pytest.raises(KeyError):
        arrayio.load(path)


# ---- parse_arm --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("posix", Arm("posix")),
        ("  posix  ", Arm("posix")),
        ("posix()", Arm("posix")),
        ("posix(threads=4)", Arm.of("posix", threads=4)),
        (" posix ( threads = 4 , task_size=1048576 ) ", Arm.of("posix", threads=4, task_size=MiB)),
        ("posix(task_size=1048576,threads=4)", Arm.of("posix", threads=4, task_size=MiB)),
        ("posix(threads=4,)", Arm.of("posix", threads=4)),
        ("staged(direct=true,threads=2)", Arm.of("staged", direct=True, threads=2)),
        ("staged(direct=TRUE)", Arm.of("staged", direct=True)),
    ],
)
def test_parse_arm(spec, expected):
    arm = parse_arm(spec)
    assert arm == expected
    assert arm.params == expected.params  # values keep their types: 4, not "4"; True, not 1
    assert [type(value) for _, value in arm.params] == [type(value) for _, value in expected.params]


def test_parse_arm_passes_arms_and_tools_through():
    arm = Arm.of("posix", threads=2)
    assert parse_arm(arm) is arm
    tool = tools.make("posix", threads=2, task_size=MiB)
    try:
        assert parse_arm(tool) == Arm.of("posix", threads=2, task_size=MiB)
    finally:
        tool.close()
    assert parse_arm(parse_arm("posix(threads=2)").label) == Arm.of("posix", threads=2)


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "   ",
        "(threads=4)",
        "posix(threads=4",
        "posix threads=4",
        "posix(threads=4)x",
        "posix(threads)",
        "posix(threads=4,task_size)",
        "posix(=4)",
        "posix(threads=1,threads=2)",
        # A value the tool refuses, a parameter it does not take, a value of the wrong kind.
        "posix(threads=-1)",
        "staged(direct=true,pinned=False)",
        "posix(mode=fast)",
        "posix(threads=1.5)",
    ],
)
def test_parse_arm_refuses_malformed_specs(spec):
    with pytest.raises(ValueError):  # a ConfigError (tests/test_config.py)
        parse_arm(spec)


def test_parse_arm_refuses_unknown_names():
    with pytest.raises(UnknownToolError, match="'nope'"):
        parse_arm("nope(threads=4)")


# ---- tools that cannot checksum ---------------------------------------------------------


def test_a_forced_tool_without_checksums_saves_files_that_load_with_verify(
    tmp_path, registry, fresh
):
    tools.register("nocrc", NoChecksums, clobber=True)
    NoChecksums.handed = []
    tree = random_tree(8, {"big": 2 * MiB, "small": 4096})
    path = tmp_path / "w.safetensors"
    arrayio.save(path, tree, tool="nocrc")
    assert NoChecksums.handed == [None, None]  # never asked for a checksum it cannot make
    with arrayio.open(path) as reader:
        assert reader["big"].crc32c is None and reader["small"].crc32c is None
    assert_same(arrayio.load(path, verify=True), tree)
    # The same data saved normally does record checksums.
    arrayio.save(path, tree)
    assert_checksums_recorded(path, tree)


def test_a_forced_tool_without_checksums_refuses_verified_loads(tmp_path, registry, fresh):
    tools.register("nocrc", NoChecksums, clobber=True)
    NoChecksums.handed = []
    tree = random_tree(9, {"big": 2 * MiB, "small": 4096})
    path = tmp_path / "w.safetensors"
    arrayio.save(path, tree)
    for key in tree:
        with pytest.raises(ToolUnavailableError, match="verify=False"):
            arrayio.load(path, keys=key, tool="nocrc")
        with pytest.raises(ToolUnavailableError, match="verify=False"):
            arrayio.load(path, keys=key, tool="nocrc", verify=True)
    assert NoChecksums.handed == []  # refused before any I/O
    assert_same(arrayio.load(path, tool="nocrc", verify=False), tree)
    assert dispatcher.get().last[1].label == "nocrc"
    with arrayio.config.set(verify_checksums=False):
        assert_same(arrayio.load(path, tool="nocrc"), tree)
    assert all(context["unavailable"] == {} for context in contexts_of(arrayio.explain()).values())


# ---- persistence across processes --------------------------------------------------------


_LEARN = """
    import json, sys
    from pathlib import Path
    import numpy as np
    import arrayio
    from arrayio.dispatch import dispatcher

    directory = Path(sys.argv[1])
    rng = np.random.default_rng(0)
    tree = {"a": rng.standard_normal(1 << 20, dtype=np.float32),        # 4 MiB
            "b": rng.integers(0, 256, 16 << 20, dtype=np.uint8)}       # 16 MiB
    # One whole call per arm, as tune() learns: a few dozen calls are enough.
    dispatcher.get().policy.within_calls = False
    for _ in range(80):
        for key, array in tree.items():  # one file each: a context per size
            path = directory / f"{key}.safetensors"
            arrayio.save(path, {key: array})
            path.read_bytes()  # warm, whichever tool wrote it
            assert arrayio.load(path)[key].tobytes() == array.tobytes()
        contexts = arrayio.explain().explanations
        if len(contexts) >= 4 and all(e.phase == "exploiting" for e in contexts):
            break
    print(json.dumps({e.key: e.chosen for e in arrayio.explain().explanations
                      if e.phase == "exploiting"}))
"""

_EXPLOIT = """
    import json, sys
    from pathlib import Path
    import numpy as np
    import arrayio
    from arrayio.dispatch import dispatcher

    directory = Path(sys.argv[1])
    before = {e.key: [e.phase, e.chosen] for e in arrayio.explain().explanations}
    assert dispatcher.get().last is None  # nothing transferred yet
    # As in the first process, whose saves after its first load went through the page
    # cache (it had read back what it wrote there): a small file written and read back.
    arrayio.save(directory / "prime.safetensors", {"p": np.zeros(2 << 20, np.uint8)})
    arrayio.load(directory / "prime.safetensors")
    rng = np.random.default_rng(1)
    used = {}
    for key, array in {"a": rng.standard_normal(1 << 20, dtype=np.float32),
                       "b": rng.integers(0, 256, 16 << 20, dtype=np.uint8)}.items():
        path = directory / f"{key}.safetensors"
        arrayio.save(path, {key: array})
        context, arm = dispatcher.get().last
        used[context.key()] = arm.label
        path.read_bytes()
        assert arrayio.load(path)[key].tobytes() == array.tobytes()
        context, arm = dispatcher.get().last
        used[context.key()] = arm.label
    after = {e.key: e.phase for e in arrayio.explain().explanations}
    print(json.dumps({"before": before, "used": used, "after": after}))
"""


def test_what_one_process_learns_the_next_exploits_at_once(tmp_path):
    cache, data = tmp_path / "cache", tmp_path / "data"
    data.mkdir()
    env = {"ARRAYIO_CACHE_DIR": str(cache)}
    learned = json.loads(run_python(_LEARN, str(data), env=env, cwd=tmp_path))
    assert {key.split("/")[0] for key in learned} == {"read", "write"}
    assert {key.split("/")[2] for key in learned} >= {"2^22", "2^24"}

    [table_file] = cache.glob("dispatch-*.json")
    table = json.loads(table_file.read_text())
    assert table["format"] and table["version"] >= 1
    assert set(learned) <= set(table["contexts"])
    for key, chosen in learned.items():
        assert (table["contexts"][key]["phase"], table["contexts"][key]["chosen"]) == (
            "exploiting",
            chosen,
        )

    second = json.loads(run_python(_EXPLOIT, str(data), env=env, cwd=tmp_path))
    for key, chosen in learned.items():
        assert second["before"][key] == ["exploiting", chosen], key
    # The same transfers in the new process use the learned winners, without exploring.
    for key, label in second["used"].items():
        assert key in learned, f"{key} was not learned by the first process"
        assert label == learned[key], key
        assert second["after"][key] == "exploiting", key


def test_a_replaced_dispatcher_does_not_overwrite_what_its_successor_learned(tmp_path):
    # reset() closes (and saves) the old dispatcher; the new one starts from that table and
    # learns more. At exit the file must hold the newest table, not the replaced one's.
    code = """
        import json, sys
        import numpy as np
        import arrayio
        from arrayio.dispatch import dispatcher

        arrayio.save("a.safetensors", {"a": np.zeros(2 << 20, np.uint8)})
        dispatcher.reset()
        arrayio.save("b.safetensors", {"b": np.zeros(8 << 20, np.uint8)})
        print(json.dumps(sorted(key for key, _ in dispatcher.get().table.items())))
    """
    cache = tmp_path / "cache"
    learned = json.loads(run_python(code, env={"ARRAYIO_CACHE_DIR": str(cache)}, cwd=tmp_path))
    assert [key.split("/")[2] for key in learned] == ["2^21", "2^23"]
    [table_file] = cache.glob("dispatch-*.json")
    assert sorted(json.loads(table_file.read_text())["contexts"]) == learned


def test_arrayio_cache_dir_none_keeps_nothing_on_disk(tmp_path):
    code = """
        import json, sys
        from pathlib import Path
        import numpy as np
        import arrayio
        from arrayio.dispatch import dispatcher

        data = Path(sys.argv[1])
        tree = {"w": np.random.default_rng(0).standard_normal(1 << 19)}  # 4 MiB
        for _ in range(10):
            arrayio.save(data / "w.safetensors", tree)
            arrayio.load(data / "w.safetensors")
        report = arrayio.tune(data, sizes=[2 << 20], caches=["warm"])
        dispatcher.get().save()
        print(json.dumps({"table_path": dispatcher.get().table_path,
                          "report_path": report.table_path,
                          "contexts": len(arrayio.explain().explanations),
                          "text": str(arrayio.explain()).splitlines()[0]}))
    """
    home, xdg, data = tmp_path / "home", tmp_path / "xdg", tmp_path / "data"
    for directory in (home, xdg, data):
        directory.mkdir()
    env = {"ARRAYIO_CACHE_DIR": "none", "HOME": str(home), "XDG_CACHE_HOME": str(xdg)}
    out = json.loads(run_python(code, str(data), env=env, cwd=tmp_path))
    assert out["table_path"] is None and out["report_path"] is None
    assert out["contexts"] >= 3  # it did learn, in memory
    assert "(in memory only)" in out["text"]
    assert list(home.iterdir()) == [] and list(xdg.iterdir()) == []
    assert [p.name for p in data.iterdir()] == ["w.safetensors"]
    assert list(tmp_path.rglob("dispatch-*.json")) == []


# ---- threads ------------------------------------------------------------------------------


def test_threads_saving_and_loading_at_once_each_get_their_own_bytes(tmp_path, fresh):
    threads, rounds = 8, 3
    barrier = threading.Barrier(threads)

    def work(worker: int) -> int:
        checked = 0
        for round_ in range(rounds):
            nbytes = 2 * MiB + worker * (256 << 10) + round_ * 4096  # 2 to 4 MiB
            tree = random_tree(100 * worker + round_, {"x": nbytes, "y": nbytes // 2 + 8})
            path = tmp_path / f"w{worker}-{round_}.safetensors"
            barrier.wait(timeout=60)
            arrayio.save(path, tree)
            barrier.wait(timeout=60)
            assert_same(arrayio.load(path), tree)
            out = np.empty_like(tree["x"])
            arrayio.read_into(path, out, key="x")
            assert out.tobytes() == tree["x"].tobytes()
            assert_checksums_recorded(path, tree)
            checked += 1
        return checked

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        assert list(pool.map(work, range(threads))) == [rounds] * threads
    loads = {entry.attributes["load"] for _, entry in fresh.table.items()}
    assert loads <= {1, 2, 4} and max(loads) > 1  # the load bucket followed the threads
    assert fresh.in_flight.bucket() == 1  # every transfer left
    assert all(context["unavailable"] == {} for context in contexts_of(arrayio.explain()).values())


# ---- candidates ----------------------------------------------------------------------------


def _reads_disk(arm: Arm) -> bool:
    params = dict(arm.params)
    return arm.name == "direct" or params.get("direct") is True


@pytest.mark.parametrize("memory", ["host", "cuda"])
@pytest.mark.parametrize("size_class", [12, 21, 24, 30, 34])
def test_warm_reads_never_explore_the_disk(memory, size_class):
    # Exploring an O_DIRECT arm on cached data reads it from the disk instead: a whole
    # transfer at a tenth of the speed (seconds for a warm checkpoint), to learn nothing.
    from arrayio.dispatch.context import Context

    def arms(cache: str, direction: str = "read") -> list[Arm]:
        return dispatcher.candidate_arms(
            Context(direction, memory, size_class, "vda", cache, 1, True)
        )

    assert arms("warm") and not any(_reads_disk(arm) for arm in arms("warm"))
    for cache in ("cold", "mixed"):  # where they serve, they stay
        assert any(_reads_disk(arm) for arm in arms(cache))
    assert any(_reads_disk(arm) for arm in arms("-", "write"))
    if size_class > 20:  # unknown cache state: all of them, as before
        assert any(_reads_disk(arm) for arm in arms("-"))


@pytest.mark.parametrize("cache", ["warm", "cold", "mixed", "-"])
@pytest.mark.parametrize("size_class", [12, 16, 21, 24, 30, 34])
def test_the_dispatcher_never_chooses_mmap_on_its_own(cache, size_class):
    # Another process that shrinks a mapped file kills the reader with SIGBUS.
    from arrayio.dispatch.context import Context

    arms = dispatcher.candidate_arms(Context("read", "host", size_class, "vda", cache, 1, True))
    assert arms and not any(arm.name == "mmap" for arm in arms)


def test_a_large_batch_of_pieces_also_tries_deeper_writes():
    # A checkpoint's 16 and 32 MiB tensors need more writes in flight than one buffer of
    # the same total size; the arms for one buffer stay, in the same order.
    from arrayio.dispatch.context import Context

    def arms(pieces: int, size_class: int = 31) -> list[str]:
        return [
            arm.label
            for arm in dispatcher.candidate_arms(
                Context("write", "cuda", size_class, "vda", "-", 1, True, pieces)
            )
        ]

    deeper = {
        "staged(chunk_size=67108864,direct=True,threads=8)",
        "staged(chunk_size=16777216,direct=True,threads=16)",
    }
    assert deeper <= set(arms(25)) and not deeper & set(arms(0))
    assert [a for a in arms(25) if a not in deeper] == arms(0)
    assert arms(21, size_class=24) == arms(0, size_class=24)  # small batches: as before


# ---- O_DIRECT refused ---------------------------------------------------------------------


@pytest.mark.skipif(
    not hasattr(os, "O_DIRECT") or not hasattr(os, "RWF_NOWAIT"),
    reason="needs O_DIRECT and page-cache probing (Linux)",
)
def test_o_direct_refused_falls_back_and_explain_says_why(tmp_path, fresh, monkeypatch):
    # Memory too short to keep the files in the page cache: cold reads try O_DIRECT.
    monkeypatch.setattr(dispatcher, "fits_in_the_page_cache", lambda nbytes, copies=2: False)
    real_open = os.open
    refused: list[str] = []

    def open_refusing_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            refused.append(os.fspath(path))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    # The direct tool reopens the caller's file with os.open(..., O_DIRECT).
    monkeypatch.setattr(direct_module.os, "open", open_refusing_direct)
    # One file per size: reading one array's end would read ahead into the next one.
    files = {
        tmp_path / f"{key}.safetensors": random_tree(10 + i, {key: nbytes})
        for i, (key, nbytes) in enumerate({"a": 8 * MiB, "b": 4 * MiB}.items())
    }
    for path, tree in files.items():
        arrayio.save(path, tree)
        evict(path)
        assert_same(arrayio.load(path), tree)
        assert fresh.last[0].cache == "cold"
    assert refused  # direct went first for cold reads, and was refused

    cold = {
        key: context
        for key, context in contexts_of(arrayio.explain()).items()
        if key.startswith("read/") and "/cold/" in key
    }
    assert {key.split("/")[2] for key in cold} == {"2^22", "2^23"}
    for key, context in cold.items():
        direct = {arm["label"]: arm for arm in context["arms"] if arm["label"].startswith("direct")}
        assert direct and set(direct) == set(context["unavailable"]), key
        for arm in direct.values():
            assert arm["state"] == "unavailable"
            assert arm["reason"].startswith("ToolUnavailableError: O_DIRECT open refused")
            assert "[Errno 22] Invalid argument" in arm["reason"]
            assert str(tmp_path) in arm["reason"]
        assert not context["chosen"].startswith("direct")
    assert len(refused) == sum(len(c["unavailable"]) for c in cold.values())

    # Later cold reads do not try direct again, and the per-file view says the same.
    tried = len(refused)
    for _ in range(3):
        for path, tree in files.items():
            evict(path)
            assert_same(arrayio.load(path), tree)
    assert len(refused) == tried
    for path in files:
        evict(path)
        report = arrayio.explain(path)
        [explanation] = report.explanations
        assert "/cold/" in explanation.key
        assert explanation.unavailable and all(
            "O_DIRECT open refused" in reason for reason in explanation.unavailable.values()
        )
        assert "O_DIRECT open refused" in str(report)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs page-cache probing (Linux)")
def test_explain_leaves_a_cold_file_cold(tmp_path, fresh):
    # explain() "changes nothing": its page-cache probe must not bring the pages it samples
    # into the cache, or the next explain (and the next load) takes a cold file for warm.
    path = tmp_path / "w.safetensors"
    arrayio.save(path, random_tree(11, {"w": 4 * MiB}))
    evict(path)
    [explanation] = arrayio.explain(path).explanations
    assert "/cold/" in explanation.key
    time.sleep(0.2)  # lets any read the probe started complete
    arrayio.load(path)
    assert fresh.last[0].cache == "cold"
    assert fresh.last[0].key() == explanation.key


def test_the_table_is_saved_between_transfers_without_waiting_for_the_disk(tmp_path, monkeypatch):
    # A save of the learned table inside a user's load or save must not fsync (two disk
    # flushes on the I/O path); an explicit save, as at exit or after tune(), is durable.
    from arrayio.integrity import _atomic

    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(
        _atomic.os,
        "fsync",
        lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)),
    )
    monkeypatch.setattr(dispatcher, "_SAVE_INTERVAL", 0.0)
    table = tmp_path / "cache" / "dispatch.json"
    active = dispatcher.Dispatcher(str(table))
    monkeypatch.setattr(dispatcher, "_dispatcher", active)
    try:
        arrayio.save(tmp_path / "a.safetensors", {"a": np.arange(1 << 19, dtype=np.float32)})
        assert table.exists()  # saved on the way, as the interval allows
        cache = str(table.parent)
        assert not any(name.startswith(cache) for name in synced)
        assert any("a.safetensors" in name for name in synced)  # the user's file is durable
        synced.clear()
        active.save()
        assert cache in synced  # the table's directory, after the table itself
        assert json.loads(table.read_text())["contexts"]
    finally:
        active.close()


# ---- what stays in the page cache ----------------------------------------------------------


@pytest.mark.parametrize("memory", ["host", "cuda"])
@pytest.mark.parametrize("size_class", [21, 24, 27, 30, 34])
@pytest.mark.parametrize("cache", ["cold", "mixed", "-"])
def test_reads_kept_in_the_page_cache_never_bypass_it(memory, size_class, cache):
    from arrayio.dispatch.candidates import bypasses_the_cache
    from arrayio.dispatch.context import Context

    def arms(keep: bool) -> list[Arm]:
        return dispatcher.candidate_arms(
            Context("read", memory, size_class, "vda", cache, 1, True, keep=keep)
        )

    kept = arms(keep=True)
    assert kept and not any(bypasses_the_cache(arm) for arm in kept)
    # Buffered, but in requests as large as the disk needs to reach its rate.
    first = dict(kept[0].params)
    assert first.get("task_size", first.get("chunk_size", 0)) >= 16 << 20


@pytest.mark.parametrize(
    ("available", "direction", "cache", "keep"),
    [
        (1 << 40, "read", "cold", True),  # room to spare: read through the cache
        (1 << 40, "read", "mixed", True),
        (1 << 40, "read", "warm", False),  # already there: nothing to decide
        (1 << 40, "write", "-", False),
        (3 << 20, "read", "cold", False),  # 2 MiB does not fit twice in 3 MiB
        (None, "read", "cold", False),  # the machine does not say
    ],
)
def test_a_read_is_kept_in_the_page_cache_when_memory_holds_it_twice(
    tmp_path, fresh, monkeypatch, available, direction, cache, keep
):
    from arrayio.runtime import _memory

    monkeypatch.setattr(_memory, "available_host_bytes", lambda max_age=0.0: available)
    monkeypatch.setattr(dispatcher, "cache_state", lambda fd, offset, nbytes: cache)
    path = tmp_path / "f.bin"
    path.write_bytes(b"\0" * (2 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        context = fresh.context(direction, fd, 0, 2 << 20, "host", True)
    finally:
        os.close(fd)
    assert context.keep is keep and context.key().endswith("/keep") is keep


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs page-cache eviction")
def test_a_cold_load_of_what_fits_in_memory_leaves_it_in_the_page_cache(tmp_path, fresh):
    """The next load of the same file is then a page-cache load (an O_DIRECT read would have
    left the cache empty, and every later load would read the disk again)."""
    from arrayio.dispatch.context import cache_state

    tree = random_tree(7, {"w": 16 * MiB})
    path = tmp_path / "kept.safetensors"
    arrayio.save(path, tree)
    for _ in range(4):  # every arm the dispatcher explores
        evict(path)
        assert_same(arrayio.load(path), tree)
        assert fresh.last[0].cache == "cold" and fresh.last[0].keep
        fd = os.open(path, os.O_RDONLY)
        try:
            if cache_state(fd, 0, path.stat().st_size) == "-":
                pytest.skip("the kernel cannot tell what is cached here")
            assert cache_state(fd, 0, path.stat().st_size) == "warm", fresh.last[1].label
        finally:
            os.close(fd)


def test_a_file_read_again_is_kept_when_memory_holds_it_once(tmp_path, fresh, monkeypatch):
    # 2 MiB with 3 MiB available: too much to keep on its first read, kept from the second;
    # and so is a file of the same directory, once one of its files was read again.
    from arrayio.runtime import _memory

    monkeypatch.setattr(_memory, "available_host_bytes", lambda max_age=0.0: 3 << 20)
    monkeypatch.setattr(dispatcher, "cache_state", lambda fd, offset, nbytes: "cold")
    first, second = tmp_path / "a.bin", tmp_path / "b.bin"
    for path in (first, second):
        path.write_bytes(b"\0" * (2 << 20))

    def keep(path: Path) -> bool:
        fd = os.open(path, os.O_RDONLY)
        try:
            return fresh.context("read", fd, 0, 2 << 20, "host", True).keep
        finally:
            os.close(fd)

    assert [keep(first), keep(first), keep(second)] == [False, True, True]
    other = tmp_path / "other"
    other.mkdir()
    (other / "c.bin").write_bytes(b"\0" * (2 << 20))
    assert keep(other / "c.bin") is False  # nothing of that directory was read again


def test_rereads_are_remembered_within_bounds(tmp_path):
    from arrayio.dispatch.rereads import ReReads

    rereads = ReReads(remembered=2)
    paths = [tmp_path / f"{i}" / "f.bin" for i in range(3)]  # a directory each
    for path in paths:
        path.parent.mkdir()
        path.write_bytes(b"x")

    def read(path: Path) -> str | None:
        fd = os.open(path, os.O_RDONLY)
        try:
            return rereads.read(fd)
        finally:
            os.close(fd)

    assert [read(path) for path in paths] == [None, None, None]
    assert read(paths[0]) is None  # forgotten: only the latest two are remembered
    assert read(paths[2]) == "file"
    paths[2].write_bytes(b"longer")  # rewritten: another file, in a directory read again
    assert read(paths[2]) == "directory"
    assert read(paths[2]) == "file"


def test_writes_are_kept_once_this_process_read_back_what_it_wrote_there(
    tmp_path, fresh, monkeypatch
):
    # A checkpoint saved, then loaded (an evaluation, a test): the next saves into that
    # directory go through the page cache, so that their loads are page-cache loads.
    from arrayio.dispatch.candidates import bypasses_the_cache
    from arrayio.dispatch.context import Context
    from arrayio.runtime import _memory

    monkeypatch.setattr(_memory, "available_host_bytes", lambda max_age=0.0: 1 << 40)
    other = tmp_path / "elsewhere"
    other.mkdir()

    def write_context(path: Path) -> Context:
        fd = os.open(path, os.O_RDWR | os.O_CREAT)
        try:
            return fresh.context("write", fd, 0, 256 << 20, "host", True)
        finally:
            os.close(fd)

    first = tmp_path / "step-1.safetensors"
    assert not write_context(first).keep  # nothing known yet: the disk's best arms
    os.replace(first, tmp_path / "renamed.safetensors")  # as an atomic save commits
    fd = os.open(tmp_path / "renamed.safetensors", os.O_RDONLY)
    try:
        fresh.context("read", fd, 0, 1 << 20, "host", True)  # read back
    finally:
        os.close(fd)
    kept = write_context(tmp_path / "step-2.safetensors")
    assert kept.keep and kept.key().endswith("/keep")
    assert fresh.candidates(kept) and not any(bypasses_the_cache(a) for a in fresh.candidates(kept))
    assert not write_context(other / "step-2.safetensors").keep  # another directory
    monkeypatch.setattr(_memory, "available_host_bytes", lambda max_age=0.0: 300 << 20)
    assert not write_context(tmp_path / "step-3.safetensors").keep  # does not fit twice


def test_a_kept_write_says_why_in_explain(tmp_path, fresh, monkeypatch):
    from arrayio.dispatch.explain import cache_rule

    assert cache_rule({"direction": "write", "keep": False}) is None
    assert "read back" in cache_rule({"direction": "write", "keep": True})


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs page-cache eviction")
def test_a_checkpoint_saved_again_after_a_load_stays_in_the_page_cache(tmp_path, fresh):
    from arrayio.dispatch.candidates import bypasses_the_cache
    from arrayio.dispatch.context import cache_state

    tree = {"w": np.arange(8 << 20, dtype=np.float32)}  # 32 MiB
    path = tmp_path / "ckpt.safetensors"
    arrayio.save(path, tree)
    assert not fresh.last[0].keep  # nothing known about this directory yet
    assert_same(arrayio.load(path), tree)  # read back what this process wrote
    for _ in range(4):  # every arm the dispatcher explores
        arrayio.save(path, tree)
        context, arm = fresh.last
        assert context.direction == "write" and context.keep and not bypasses_the_cache(arm)
        fd = os.open(path, os.O_RDONLY)
        try:
            state = cache_state(fd, 0, path.stat().st_size)
        finally:
            os.close(fd)
        if state == "-":
            pytest.skip("the kernel cannot tell what is cached here")
        assert state == "warm", arm.label
