"""Settings that cannot be understood fail clearly: tool specifications (``tool=``,
``ARRAYIO_TOOL``) and ``ARRAYIO_*`` environment variables raise :class:`ConfigError` naming
what was given and what is accepted; nothing is silently taken for something else."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import arrayio
from arrayio import ConfigError, UnknownToolError
from arrayio.dispatch.dispatcher import parse_arm


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "a.safetensors"
    arrayio.save(path, {"a": np.arange(10.0)})
    return path


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (settings are read at import), with ``env`` added to
    an environment free of the caller's ``ARRAYIO_*`` settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ARRAYIO_")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env,
                          "ARRAYIO_CACHE_DIR": "none"}, capture_output=True, text=True,
                          timeout=120, check=False)


# --------------------------------------------------------------------------- tool specs


@pytest.mark.parametrize("spec, expected", [
    ("direct(threads=four)", "threads must be a whole number"),
    ("posix(threads=1.5)", "threads must be a whole number"),
    ("posix(threads=true)", "threads must be a whole number"),
    ("staged(direct=maybe)", "direct must be true or false"),
    ("direct(bogus=1)", "no parameter 'bogus'"),
    ("posix(mode=fast)", "no parameter 'mode'"),
    ("direct(threads=4))", "NAME(key=value,...)"),
    ("direct((threads=4)", "NAME(key=value,...)"),
    ("direct(threads=4", "NAME(key=value,...)"),
    ("posix(threads)", "expected key=value"),
    ("posix(threads=1,threads=2)", "'threads' twice"),
    ("posix(threads=-1)", "must be positive"),
    ("direct(task_size=0)", "must be positive"),
])
def test_a_malformed_tool_spec_is_a_config_error(small, spec, expected):
    with pytest.raises(ConfigError, match="tool ") as caught:
        arrayio.load(small, tool=spec)
    message = str(caught.value)
    assert repr(spec) in message and expected in message
    with pytest.raises(ConfigError):
        parse_arm(spec)


def test_a_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        parse_arm("posix(threads=x)")


def test_an_unknown_tool_stays_an_unknown_tool_error(small):
    with pytest.raises(UnknownToolError, match="'nope'"):
        arrayio.load(small, tool="nope(threads=4)")


def test_valid_specs_keep_their_types():
    arm = parse_arm("staged(direct=TRUE, threads=2, chunk_size=1048576)")
    assert dict(arm.params) == {"direct": True, "threads": 2, "chunk_size": 1 << 20}
    assert [type(v) for _, v in arm.params] == [int, bool, int]  # sorted: chunk, direct, th.


def test_arrayio_tool_is_checked_where_it_is_used(small):
    result = run_python(f"import arrayio; arrayio.load({str(small)!r})",
                        ARRAYIO_TOOL="direct(threads=four)")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("arrayio.errors.ConfigError: ")
    assert "ARRAYIO_TOOL" in last and "'direct(threads=four)'" in last


def test_the_cli_reports_a_bad_arrayio_tool_as_a_usage_error(small):
    result = subprocess.run([sys.executable, "-m", "arrayio", "verify", str(small)],
                            env={**os.environ, "ARRAYIO_TOOL": "posix(threads=zero)",
                                 "ARRAYIO_CACHE_DIR": "none"},
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert "ARRAYIO_TOOL" in result.stderr and "Traceback" not in result.stderr
