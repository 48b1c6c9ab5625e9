"""Every tool that runs on a CPU machine passes the conformance suite, with parameters that
exercise both its inline path and its threaded path with many small tasks."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from arrayio import tools
from arrayio.errors import ToolUnavailableError
from arrayio.testing.tool_suite import ToolConformance, host_buffer, o_direct_refusal


class _Registered:
    """Builds the tool from the registry by name and parameters, and closes it afterwards."""

    tool_name: ClassVar[str]
    tool_params: ClassVar[dict[str, Any]] = {}

    @pytest.fixture
    def tool(self) -> Iterator[tools.Tool]:
        tool = tools.make(self.tool_name, **self.tool_params)
        yield tool
        tool.close()


class _OnDirectFileSystem:
    @pytest.fixture
    def directory(self, tmp_path: Path) -> Path:
        reason = o_direct_refusal(tmp_path)
        if reason is not None:
            pytest.skip(reason)
        return tmp_path


class TestNaive(_Registered, ToolConformance):
    tool_name = "naive"


class TestPosixOneThread(_Registered, ToolConformance):
    tool_name = "posix"
    tool_params = {"threads": 1}


class TestPosixManyTasks(_Registered, ToolConformance):
    tool_name = "posix"
    tool_params = {"threads": 4, "task_size": 64 << 10}


class TestDirectOneThread(_OnDirectFileSystem, _Registered, ToolConformance):
    tool_name = "direct"
    tool_params = {"threads": 1}


class TestDirectManyTasks(_OnDirectFileSystem, _Registered, ToolConformance):
    tool_name = "direct"
    tool_params = {"threads": 4, "task_size": 64 << 10}


class TestMmapOneThread(_Registered, ToolConformance):
    tool_name = "mmap"
    tool_params = {"threads": 1}


class TestMmapFourThreads(_Registered, ToolConformance):
    tool_name = "mmap"
    tool_params = {"threads": 4}


class _Available(_Registered):
    """GPU tools: skipped, with the tool's own reason, where they cannot run."""

    @pytest.fixture
    def tool(self) -> Iterator[tools.Tool]:
        availability = tools.tool_class(self.tool_name).availability()
        if not availability:
            pytest.skip(f"{self.tool_name}: {availability.reason}")
        tool = tools.make(self.tool_name, **self.tool_params)
        yield tool
        tool.close()


class TestStagedOneThread(_Available, ToolConformance):
    tool_name = "staged"
    tool_params = {"threads": 1, "chunk_size": 64 << 10}


class TestStagedManyChunks(_Available, ToolConformance):
    tool_name = "staged"
    tool_params = {"threads": 4, "chunk_size": 64 << 10}


class TestStagedDirect(_OnDirectFileSystem, _Available, ToolConformance):
    tool_name = "staged"
    tool_params = {"threads": 4, "chunk_size": 64 << 10, "direct": True}


class TestPagecacheOneThread(_Available, ToolConformance):
    tool_name = "pagecache"
    tool_params = {"threads": 1, "window": 64 << 10}


class TestPagecacheManyWindows(_Available, ToolConformance):
    tool_name = "pagecache"
    tool_params = {"threads": 4, "window": 64 << 10}


class TestKvikio(_Available, ToolConformance):
    tool_name = "kvikio"
    tool_params = {"threads": 4, "task_size": 64 << 10}


def test_direct_refused_on_tmpfs() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir=shm) as name:
        directory = Path(name)
        if o_direct_refusal(directory) is None:
            pytest.skip("this kernel's tmpfs accepts O_DIRECT (it does from Linux 6.6 on)")
        path = directory / "data.bin"
        path.write_bytes(b"\1" * 10_000)
        fd = os.open(path, os.O_RDWR)
        tool = tools.make("direct", threads=1)
        try:
            with pytest.raises(ToolUnavailableError, match="O_DIRECT.*tmpfs"):
                tool.read(fd, host_buffer(8192), 0)
            with pytest.raises(ToolUnavailableError, match="O_DIRECT.*tmpfs"):
                tool.write(fd, host_buffer(8192), 0)
        finally:
            os.close(fd)
            tool.close()
