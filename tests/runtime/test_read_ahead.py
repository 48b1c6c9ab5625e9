"""Reading a module's files into the page cache before its import (a tool's set-up beside a
cold load): which files, and that reading them never fails the set-up."""

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


def test_reads_every_byte_and_skips_what_cannot_be_opened(site):
    files = _read_ahead.files_of(["fakepkg", "fakemod"])
    total = sum(os.path.getsize(path) for path in files if os.path.exists(path))
    assert _read_ahead.read_ahead([*files, str(site / "missing.so")]) == total
    assert total > 3 << 20


def test_kvikio_reads_its_files_ahead_before_importing(monkeypatch):
    from arrayio.tools import kvikio as kvikio_tool

    order = []
    monkeypatch.setattr(
        kvikio_tool._read_ahead, "read_ahead", lambda paths: order.append("read ahead") or 0
    )
    monkeypatch.setattr(kvikio_tool._read_ahead, "files_of", lambda modules: list(modules))

    class Stop(Exception):
        pass

    def importing():
        order.append("import")
        raise Stop

    monkeypatch.setattr(kvikio_tool, "_import_kvikio", importing)
    with pytest.raises(Stop):
        kvikio_tool.KvikioTool().prepare()
    assert order == ["read ahead", "import"]
