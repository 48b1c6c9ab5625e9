"""Asking for a module's files before its import (a tool's set-up beside a cold load): which
files, and that asking never fails the call."""

from __future__ import annotations

import os
import sys

import pytest

from arrayio.runtime import _read_ahead


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A package ``fakepkg`` with a C extension and a vendored library beside it (as an
    auditwheel-repaired wheel installs it), and a plain module ``fakemod``."""
    package = tmp_path / "fakepkg"
    (package / "_lib").mkdir(parents=True)
    (package / "__init__.py").write_text("X = 1\n")
    (package / "_lib" / "__init__.py").write_text("")
    (package / "_lib" / "ext.abi3.so").write_bytes(b"\x7fELF" + bytes(5000))
    (package / "README.txt").write_text("not read by an import")
    vendored = tmp_path / "fakepkg_cu13.libs"
    vendored.mkdir()
    (vendored / "libzstd-0d65.so.1.5.7").write_bytes(bytes(3 << 20))
    (tmp_path / "unrelated.libs").mkdir()
    (tmp_path / "unrelated.libs" / "libother.so").write_bytes(b"x")
    (tmp_path / "fakemod.py").write_text("Y = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("fakepkg", "fakepkg._lib", "fakemod"):
        sys.modules.pop(name, None)


def test_a_packages_files_and_its_vendored_libraries(site):
    files = _read_ahead.files_of(["fakepkg"])
    names = {os.path.relpath(path, site) for path in files}
    assert names == {
        "fakepkg/__init__.py",
        "fakepkg/_lib/__init__.py",
        "fakepkg/_lib/ext.abi3.so",
        "fakepkg_cu13.libs/libzstd-0d65.so.1.5.7",
    }
    assert "fakepkg" not in sys.modules  # found, not imported


def test_a_plain_module_and_its_bytecode(site):
    source, bytecode = sorted(_read_ahead.files_of(["fakemod"]), key=len)
    assert source == str(site / "fakemod.py")
    assert bytecode.endswith(".pyc") and os.path.dirname(bytecode) == str(site / "__pycache__")
    assert "fakemod" not in sys.modules


def test_modules_not_installed_add_nothing(site):
    assert _read_ahead.files_of(["no_such_module_here", "no_such.sub"]) == []


def test_asks_for_every_file_and_skips_what_cannot_be_opened(site):
    files = _read_ahead.files_of(["fakepkg", "fakemod"])
    present = [path for path in files if os.path.exists(path)]
    assert _read_ahead.ask_for([*files, str(site / "missing.so")]) == len(present) == 5


def test_kvikio_asks_for_its_import_s_files(monkeypatch):
    from arrayio.tools import kvikio as kvikio_tool

    asked = []
    monkeypatch.setattr(kvikio_tool._read_ahead, "files_of", lambda modules: list(modules))
    monkeypatch.setattr(kvikio_tool._read_ahead, "ask_for", lambda paths: asked.extend(paths))
    kvikio_tool.KvikioTool.read_ahead()
    assert asked == list(kvikio_tool.IMPORTS) and "kvikio" in asked and "libkvikio" in asked


def test_a_fifo_named_like_a_library_is_skipped_not_waited_on(site):
    # Opening a FIFO for reading waits for a writer: the load's thread must not.
    os.mkfifo(site / "fakepkg" / "socket.so")
    files = _read_ahead.files_of(["fakepkg"])
    assert str(site / "fakepkg" / "socket.so") in files
    assert _read_ahead.ask_for(files) == 4  # the package's regular files only


def test_a_parent_package_that_fails_to_import_loses_only_its_module(site):
    broken = site / "brokenparent"
    (broken / "child").mkdir(parents=True)
    (broken / "__init__.py").write_text("raise RuntimeError('broken parent')\n")
    (broken / "child" / "__init__.py").write_text("")
    files = _read_ahead.files_of(["brokenparent.child", "fakemod"])
    assert files and all("brokenparent" not in path for path in files)
    sys.modules.pop("brokenparent", None)
