"""Shared pieces of the fault tests: child processes running ``_child.py``, the data they
write, arrayio's temporary files, and the environment variables that make the loops
longer for a nightly run.

Every child runs with the repository's ``arrayio`` first on its path, without the caller's
``ARRAYIO_*`` settings, and with the dispatcher's table in a directory under the test's
``tmp_path``; a child still running when its test ends is killed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

CHILD = Path(__file__).with_name("_child.py")
ROOT = Path(__file__).resolve().parents[2]
TEMP_MARKER = ".arrayio-tmp-"


def env_int(name: str, default: int) -> int:
    """An integer from the environment (the nightly job's knobs), else ``default``."""
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def _load_child() -> ModuleType:
    spec = importlib.util.spec_from_file_location("arrayio_fault_child", CHILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def child() -> ModuleType:
    """``_child.py`` as a module: the data its modes write (``version``...)."""
    return _load_child()


def temporaries(directory: Path) -> list[Path]:
    """arrayio's temporary files anywhere under ``directory``."""
    return sorted(p for p in directory.rglob("*") if TEMP_MARKER in p.name)


class Child:
    """A running ``_child.py``; its stdout lines arrive in :attr:`lines`."""

    def __init__(self, process: subprocess.Popen[str], stderr: Path) -> None:
        self.process = process
        self.stderr_path = stderr
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        try:
            for line in self.process.stdout:
                self.lines.put(line.rstrip("\n"))
        except ValueError:  # the stream was closed under it: the child's output is over
            pass
        self.lines.put(None)

    def next_line(self, timeout: float = 60) -> str | None:
        """The next line, or None once the child has closed stdout.

        Raises
        ------
        TimeoutError
            If no line comes within ``timeout`` seconds.
        """
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"no output from the child for {timeout} s; stderr:\n{self.stderr()}"
            ) from None

    def wait_for(self, prefix: str, timeout: float = 60) -> str:
        """Skip lines until one starts with ``prefix``; fail if the child ends first."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.next_line(max(0.1, deadline - time.monotonic()))
            if line is None:
                self.process.wait()
                pytest.fail(
                    f"the child exited ({self.process.returncode}) before "
                    f"{prefix!r}; stderr:\n{self.stderr()}"
                )
            if line.startswith(prefix):
                return line

    def kill(self) -> int:
        self.process.kill()
        return self.process.wait()

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""


def child_environment(tmp_path: Path, **settings: str | None) -> dict[str, str]:
    """The environment of a child: no caller ``ARRAYIO_*``, this repository's arrayio, the
    dispatcher's table under ``tmp_path``; ``settings`` add ``ARRAYIO_*`` variables (None
    leaves one unset)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARRAYIO_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["ARRAYIO_CACHE_DIR"] = str(tmp_path / "cache")
    env["ARRAYIO_PROGRESS"] = "0"
    env["PYTHONFAULTHANDLER"] = "1"
    for name, value in settings.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    """``spawn(mode, *args, env=None, stdin=False)`` starts ``_child.py mode args`` and
    returns a :class:`Child`; children still alive at the end of the test are killed."""
    started: list[Child] = []
    counter = iter(range(10**9))

    def start(
        mode: str, *args: str, env: dict[str, str] | None = None, stdin: bool = False
    ) -> Child:
        stderr = tmp_path / f"child-{next(counter)}-{mode}.err"
        with open(stderr, "wb") as err:
            process = subprocess.Popen(
                [sys.executable, str(CHILD), mode, *args],
                cwd=ROOT,
                env=env or child_environment(tmp_path),
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                text=True,
            )
        started.append(Child(process, stderr))
        return started[-1]

    yield start
    for running in started:
        if running.process.poll() is None:
            running.kill()
        running.pump.join(10)  # the child is gone: its output ends, then the pump
        for stream in (running.process.stdout, running.process.stdin):
            if stream is not None:
                stream.close()


def assert_arrays_equal(got: Any, want: Any, where: str) -> None:
    """Equal keys, dtypes, shapes and values, recursively (constants compared with ==)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (
            f"{where}: keys {list(got) if isinstance(got, dict) else type(got)} != {list(want)}"
        )
        for key in want:
            assert_arrays_equal(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: {type(got).__name__}, not an array"
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: {got.dtype}{got.shape} != {want.dtype}{want.shape}"
        )
        assert np.array_equal(got, want), f"{where}: values differ"
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def dispatch_tables(cache_dir: Path) -> list[tuple[Path, Any]]:
    """The dispatch tables (JSON) a child left in ``cache_dir``."""
    return [(path, json.loads(path.read_text())) for path in sorted(cache_dir.glob("*.json"))]


def unavailable_arms(table: Any) -> list[str]:
    """Every ``"unavailable"`` entry with a reason, as ``context / arm: reason``."""
    found: list[str] = []

    def visit(node: Any, where: str) -> None:
        if isinstance(node, dict):
            if node.get("unavailable"):
                found.append(f"{where}: {node['unavailable']}")
            for key, value in node.items():
                visit(value, f"{where}/{key}" if where else str(key))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                visit(value, f"{where}[{index}]")

    visit(table, "")
    return found


@pytest.fixture(scope="session")
def faults() -> ModuleType:
    """This module, for its helpers (test modules cannot import it under
    ``--import-mode=importlib``): ``faults.temporaries(path)``, ``faults.env_int(...)``..."""
    return sys.modules[__name__]
