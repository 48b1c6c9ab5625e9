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
from arrayio import ConfigError, UnknownToolError, config
from arrayio.dispatch.dispatcher import parse_arm


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "a.safetensors"
    arrayio.save(path, {"a": np.arange(10.0)})
    return path


def run_python(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a fresh interpreter (settings are read at import), with ``env``
    added to an environment free of the caller's ``ARRAYIO_*`` settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ARRAYIO_")}
    return subprocess.run(
        [sys.executable, *args],
        env={**clean, **env, "ARRAYIO_CACHE_DIR": "none"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# --------------------------------------------------------------------------- tool specs


@pytest.mark.parametrize(
    "spec, expected",
    [
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
    ],
)
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
    result = run_python(
        "-c", f"import arrayio; arrayio.load({str(small)!r})", ARRAYIO_TOOL="direct(threads=four)"
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("arrayio.errors.ConfigError: ")
    assert "ARRAYIO_TOOL" in last and "'direct(threads=four)'" in last


def test_the_cli_reports_a_bad_arrayio_tool_as_a_usage_error(small):
    result = run_python("-m", "arrayio", "verify", str(small), ARRAYIO_TOOL="posix(threads=zero)")
    assert result.returncode == 2, result.stderr
    assert "ARRAYIO_TOOL" in result.stderr and "Traceback" not in result.stderr


# --------------------------------------------------------------------------- environment


@pytest.mark.parametrize(
    "variable, value, accepted",
    [
        ("ARRAYIO_VERIFY_CHECKSUMS", "maybe", "1, true, yes, on, 0, false, no or off"),
        ("ARRAYIO_VERIFY_CHECKSUMS", "2", "1, true, yes, on, 0, false, no or off"),
        ("ARRAYIO_GC_PAUSE", "enabled", "1, true, yes, on, 0, false, no or off"),
        ("ARRAYIO_PROGRESS", "sometimes", "auto, 1, true, yes, on, 0, false, no or off"),
        ("ARRAYIO_ALIGNMENT", "abc", "a whole number"),
        ("ARRAYIO_ALIGNMENT", "4k", "a whole number"),
        ("ARRAYIO_ALIGNMENT", "1000", "power of two"),
        ("ARRAYIO_STAGING_BYTES", "lots", "a whole number"),
        ("ARRAYIO_STAGING_BYTES", "100", "at least 4096"),
        ("ARRAYIO_ASYNC_WORKERS", "0", "at least 1"),
        ("ARRAYIO_ASYNC_WORKERS", "1.5", "a whole number"),
    ],
)
def test_a_variable_that_cannot_be_read_is_a_config_error(monkeypatch, variable, value, accepted):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as caught:
        config._from_environment()
    message = str(caught.value)
    assert message.startswith(f"{variable}={value!r}: ") and accepted in message


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1", True),
        ("true", True),
        (" Yes ", True),
        ("ON", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("Off", False),
        ("", True),
        (None, True),  # unset or empty: the default
    ],
)
def test_boolean_spellings(monkeypatch, value, expected):
    for variable in ("ARRAYIO_VERIFY_CHECKSUMS", "ARRAYIO_GC_PAUSE", "ARRAYIO_SECOND_PASS"):
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
    settings = config._from_environment()
    assert settings.verify_checksums is expected and settings.gc_pause is expected
    assert settings.second_pass is expected


def test_integer_spellings(monkeypatch):
    monkeypatch.setenv("ARRAYIO_ALIGNMENT", " 8192 ")
    monkeypatch.setenv("ARRAYIO_STAGING_BYTES", "")
    monkeypatch.setenv("ARRAYIO_ASYNC_WORKERS", "2")
    settings = config._from_environment()
    assert (settings.alignment, settings.staging_bytes, settings.async_workers) == (
        8192,
        64 << 20,
        2,
    )


def test_import_never_raises_the_first_use_does(small):
    code = f"""
import arrayio
print("imported")
try:
    arrayio.load({str(small)!r})
except arrayio.ConfigError as error:
    print("first use:", error)
with arrayio.config.set(verify_checksums=True, async_workers=2):  # replaces the bad values
    print("overridden:", float(arrayio.load({str(small)!r})["a"].sum()))
try:
    arrayio.config.get()
except ValueError as error:
    print("after the block:", type(error).__name__)
"""
    result = run_python("-c", code, ARRAYIO_VERIFY_CHECKSUMS="maybe", ARRAYIO_ASYNC_WORKERS="0")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "imported"
    assert lines[1].startswith("first use: ARRAYIO_VERIFY_CHECKSUMS='maybe': ")
    assert "ARRAYIO_ASYNC_WORKERS='0': " in lines[1]
    assert lines[2] == "overridden: 45.0"
    assert lines[3] == "after the block: ConfigError"


def test_settings_refuse_bad_values_with_config_error():
    with pytest.raises(ConfigError, match="power of two"):
        config.set(alignment=3)
    with pytest.raises(ConfigError, match="at least 1"):
        config.set(async_workers=0)


def test_the_cli_reports_a_bad_variable_as_a_usage_error(small):
    result = run_python("-m", "arrayio", "verify", str(small), ARRAYIO_ALIGNMENT="abc")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("arrayio verify: ARRAYIO_ALIGNMENT='abc': ")
