"""Progress bars: when they appear (interactive or asked for, long operations only), where
(stderr, Jupyter), and what happens without tqdm.

Interactivity is mocked: under pytest stderr is captured, hence never a terminal.
"""

from __future__ import annotations

import io
import sys
import types
import warnings

import numpy as np
import pytest

import arrayio
from arrayio import cli, config
from arrayio.errors import FrameworkNotAvailableError
from arrayio.runtime import _progress

MiB = 1 << 20


@pytest.fixture
def watched(monkeypatch):
    """Pretend someone watches (a terminal)."""
    monkeypatch.setattr(_progress, "interactive", lambda: True)


@pytest.fixture
def small_threshold(monkeypatch):
    """Bars appear at once from 1 KiB, so tests need no 256 MiB files."""
    monkeypatch.setattr(_progress, "INSTANT_BYTES", 1024)


@pytest.fixture
def no_tqdm(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.std", None)
    monkeypatch.setattr(_progress, "_warned_missing", False)


# --------------------------------------------------------------------------- the decision


@pytest.mark.parametrize(
    "progress, interactive, total, expected",
    [
        (None, False, 1 << 30, None),  # automatic and nobody watches: never
        (None, True, 1 << 30, 0.0),  # automatic, watched, large: at once
        (None, True, 256 * MiB, 0.0),
        (None, True, 256 * MiB - 1, _progress.SLOW_SECONDS),  # smaller: only if slow
        (None, True, 1, _progress.SLOW_SECONDS),
        (True, False, 1 << 30, 0.0),  # asked for: in logs too
        (True, False, MiB, _progress.SLOW_SECONDS),
        (False, True, 1 << 30, None),  # refused: never
        (True, True, 0, None),  # nothing to do
    ],
)
def test_when_a_bar_appears(monkeypatch, progress, interactive, total, expected):
    monkeypatch.setattr(_progress, "interactive", lambda: interactive)
    assert _progress.delay_for(total, progress=progress) == expected


def test_counts_of_steps_only_use_the_time_threshold(watched):
    assert _progress.delay_for(10**9, unit="case") == _progress.SLOW_SECONDS


@pytest.mark.parametrize(
    "setting, interactive, expected",
    [(None, False, None), (None, True, 0.0), (True, False, 0.0), (False, True, None)],
)
def test_the_setting_decides_when_the_call_does_not(monkeypatch, setting, interactive, expected):
    monkeypatch.setattr(_progress, "interactive", lambda: interactive)
    with config.set(progress=setting):
        assert _progress.delay_for(1 << 30) == expected
        assert _progress.delay_for(1 << 30, progress=False) is None
        assert _progress.delay_for(1 << 30, progress=True) == 0.0


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        ("", None),
        ("auto", None),
        (" AUTO ", None),
        ("1", True),
        ("yes", True),
        ("true", True),
        ("0", False),
        ("off", False),
        ("False", False),
    ],
)
def test_the_environment_variable(value, expected):
    assert config._progress_from(value) is expected


def test_the_environment_variable_is_read_at_import(monkeypatch):
    monkeypatch.setenv("ARRAYIO_PROGRESS", "1")
    assert config._from_environment().progress is True
    monkeypatch.delenv("ARRAYIO_PROGRESS")
    assert config._from_environment().progress is None


# --------------------------------------------------------------------------- interactivity


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


@pytest.mark.parametrize(
    "stream, expected", [(_Stream(True), True), (_Stream(False), False), (None, False)]
)
def test_a_terminal_is_interactive(monkeypatch, stream, expected):
    monkeypatch.setitem(sys.modules, "IPython", None)
    monkeypatch.setattr(sys, "stderr", stream)
    assert _progress.interactive() is expected


def test_a_closed_stream_is_not_interactive(monkeypatch):
    stream = io.StringIO()
    stream.close()
    monkeypatch.setattr(sys, "stderr", stream)
    assert _progress.interactive() is False


def fake_ipython(config: dict | None) -> types.ModuleType:
    module = types.ModuleType("IPython")
    shell = None if config is None else types.SimpleNamespace(config=config)
    module.get_ipython = lambda: shell
    return module


@pytest.mark.parametrize(
    "config_, expected",
    [
        ({"IPKernelApp": {"connection_file": "x"}}, True),  # a Jupyter kernel
        ({"TerminalInteractiveShell": {}}, False),  # IPython in a terminal (stderr decides)
        (None, False),  # IPython imported, no shell running
    ],
)
def test_jupyter_is_interactive(monkeypatch, config_, expected):
    monkeypatch.setitem(sys.modules, "IPython", fake_ipython(config_))
    monkeypatch.setattr(sys, "stderr", _Stream(False))
    assert _progress.in_jupyter() is expected
    assert _progress.interactive() is expected


def test_in_jupyter_text_bars_without_ipywidgets(monkeypatch):
    from tqdm import std

    monkeypatch.setattr(_progress, "in_jupyter", lambda: True)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    assert _progress._tqdm_class(True, False) is std.tqdm


# --------------------------------------------------------------------------- the bars


def test_save_and_load_show_bars_when_asked(tmp_path, capsys, small_threshold):
    pytest.importorskip("tqdm")
    path = tmp_path / "x.safetensors"
    tree = {"a": np.zeros(4096, np.uint8), "b": np.ones(8192, np.uint8)}
    arrayio.save(path, tree, progress=True)
    err = capsys.readouterr().err
    assert f"saving {path}" in err and "12.0k" in err.lower()
    arrayio.load(path, progress=True)
    err = capsys.readouterr().err
    assert f"loading {path}" in err
    arrayio.load(path, keys=["a"], progress=True)
    assert "4.00k" in capsys.readouterr().err.lower()  # the selected arrays' total
    arrayio.save(tmp_path / "y.npy", np.zeros(4096, np.uint8), progress=True)
    assert "saving" in capsys.readouterr().err


def test_non_interactive_runs_show_nothing_by_default(tmp_path, capsys, small_threshold):
    path = tmp_path / "x.safetensors"
    arrayio.save(path, {"a": np.zeros(1 << 16, np.uint8)})
    arrayio.load(path)
    assert capsys.readouterr().err == ""


def test_watched_runs_show_large_operations_only(tmp_path, capsys, watched, small_threshold):
    pytest.importorskip("tqdm")
    arrayio.save(tmp_path / "large.safetensors", {"a": np.zeros(4096, np.uint8)})
    assert "saving" in capsys.readouterr().err
    arrayio.save(tmp_path / "small.safetensors", {"a": np.zeros(100, np.uint8)})
    assert capsys.readouterr().err == ""  # under the threshold, and quick
    arrayio.save(tmp_path / "large.safetensors", {"a": np.zeros(4096, np.uint8)}, progress=False)
    assert capsys.readouterr().err == ""


def test_the_bar_counts_what_is_done(monkeypatch, watched):
    pytest.importorskip("tqdm")
    seen = []

    class Recorder:
        def __init__(self, **kwargs):
            seen.append(kwargs)
            self.n = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def update(self, n):
            self.n += n
            seen.append(self.n)

    monkeypatch.setattr(_progress, "_tqdm_class", lambda asked, from_setting: Recorder)
    with _progress.bar(300 * MiB, desc="job") as advance:
        advance(100 * MiB)
        advance(200 * MiB)
    options, *counts = seen
    assert options["total"] == 300 * MiB and options["desc"] == "job"
    assert options["delay"] == 0.0 and options["unit"] == "B" and options["unit_scale"]
    assert counts == [100 * MiB, 300 * MiB]


def test_no_bar_yields_a_no_op(monkeypatch):
    monkeypatch.setattr(_progress, "_tqdm_class", lambda *a: pytest.fail("no bar wanted"))
    with _progress.bar(1 << 30, desc="job", progress=False) as advance:
        advance(5)


# --------------------------------------------------------------------------- without tqdm


def test_without_tqdm_asking_raises_with_an_install_hint(tmp_path, no_tqdm, small_threshold):
    with pytest.raises(FrameworkNotAvailableError, match=r"pip install 'arrayio\[progress\]'"):
        arrayio.save(tmp_path / "x.safetensors", {"a": np.zeros(4096, np.uint8)}, progress=True)
    assert not (tmp_path / "x.safetensors").exists()


def test_without_tqdm_the_setting_warns_once(tmp_path, no_tqdm, small_threshold):
    with config.set(progress=True):
        with pytest.warns(RuntimeWarning, match=r"ARRAYIO_PROGRESS is on but .*tqdm"):
            arrayio.save(tmp_path / "x.safetensors", {"a": np.zeros(4096, np.uint8)})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            arrayio.save(tmp_path / "x.safetensors", {"a": np.zeros(4096, np.uint8)})
    assert arrayio.load(tmp_path / "x.safetensors")["a"].nbytes == 4096


def test_without_tqdm_automatic_bars_are_skipped_silently(
    tmp_path, no_tqdm, watched, small_threshold
):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        arrayio.save(tmp_path / "x.safetensors", {"a": np.zeros(4096, np.uint8)})


# --------------------------------------------------------------------------- the CLI


def test_the_cli_flags(tmp_path, capsys, small_threshold, monkeypatch):
    pytest.importorskip("tqdm")
    path = tmp_path / "x.safetensors"
    arrayio.save(path, {"a": np.zeros(8192, np.uint8)})
    assert cli.main(["verify", str(path), "--progress"]) == 0
    assert f"verifying {path}" in capsys.readouterr().err
    monkeypatch.setattr(_progress, "interactive", lambda: True)
    assert cli.main(["verify", str(path), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    assert cli.main(["convert", str(path), str(tmp_path / "y.safetensors"), "--progress"]) == 0
    err = capsys.readouterr().err
    assert f"loading {path}" in err and "saving" in err
    assert config.get().progress is None  # the flag held for the command only


def test_the_cli_without_tqdm_exits_3(tmp_path, capsys, no_tqdm, small_threshold):
    path = tmp_path / "x.safetensors"
    arrayio.save(path, {"a": np.zeros(8192, np.uint8)})
    assert cli.main(["convert", str(path), str(tmp_path / "y.npz"), "--progress"]) == 3
    assert "arrayio[progress]" in capsys.readouterr().err
