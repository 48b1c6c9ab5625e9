"""Shared fixtures: ``xp`` runs a test once per framework (and device) that is installed.

GPU cases carry the ``gpu`` marker and are skipped, at run time rather than collection time,
where no CUDA device is usable; a missing framework skips only its own cases.

The session, and every process it starts, keeps its temporary files in a directory of its
own (``TMPDIR``), removed at the end; anything named ``arrayio-*`` left in it fails the
session. Its own directory tells exactly what this session left: comparing the system's
``/tmp`` before and after would also count what sessions running beside it create.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from arrayio.testing import FRAMEWORK_PARAMS, Framework, gpu_available


def _params(device: str | None = None) -> list:
    params = []
    for framework in FRAMEWORK_PARAMS:
        if device is not None and framework.device != device:
            continue
        marks = [pytest.mark.gpu] if framework.device == "cuda" else []
        params.append(pytest.param(framework, id=framework.id, marks=marks))
    return params


def _skip_unless_usable(framework: Framework) -> Framework:
    reason = framework.usable()
    if reason is not None:
        pytest.skip(reason)
    return framework


@pytest.fixture(params=_params("cpu"))
def xp(request: pytest.FixtureRequest) -> Framework:
    """A CPU framework: numpy, jax or torch."""
    return _skip_unless_usable(request.param)


@pytest.fixture(params=_params("cpu"))
def xp_target(request: pytest.FixtureRequest) -> Framework:
    """A second CPU framework, to load into what ``xp`` saved."""
    return _skip_unless_usable(request.param)


@pytest.fixture(params=_params("cuda"))
def gpu_xp(request: pytest.FixtureRequest) -> Framework:
    """A GPU framework: cupy, jax or torch on cuda:0."""
    return _skip_unless_usable(request.param)


@pytest.fixture(params=_params())
def any_xp(request: pytest.FixtureRequest) -> Framework:
    """Any framework on any device."""
    return _skip_unless_usable(request.param)


@pytest.fixture
def fresh():
    """A new in-memory dispatcher as the process-wide one; the usual one comes back after."""
    from arrayio.dispatch import dispatcher

    active = dispatcher.Dispatcher(None)
    dispatcher.reset(active)
    yield active
    dispatcher.reset()


_SESSION_TEMP = pytest.StashKey[tuple[str, str | None]]()


def pytest_configure(config: pytest.Config) -> None:
    import arrayio
    from arrayio.dispatch import dispatcher

    # tmp_path stays where pytest keeps (and prunes) it; everything else goes to the
    # session's own directory.
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    root = tempfile.mkdtemp(prefix="arrayio-tests-")
    config.stash[_SESSION_TEMP] = (root, os.environ.get("TMPDIR"))
    os.environ["TMPDIR"] = tempfile.tempdir = root
    # What the dispatcher learns during the tests stays there too, never in the user's
    # ~/.cache/arrayio.
    arrayio.config.set(cache_dir=os.path.join(root, "dispatch-cache"))
    dispatcher.reset()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _SESSION_TEMP not in session.config.stash:
        return
    root, previous = session.config.stash[_SESSION_TEMP]
    left = sorted(name for name in os.listdir(root) if name.startswith("arrayio-"))
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (
            f"temporary files or directories left behind by the tests (now "
            f"removed): {', '.join(left)}"
        )
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(message, red=True, bold=True)
        else:
            print(message, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    import arrayio
    from arrayio.dispatch import dispatcher

    dispatcher.reset()  # saves the table now, not at exit into a directory that is gone
    arrayio.config.set(cache_dir=None)
    shutil.rmtree(root, ignore_errors=True)
    tempfile.tempdir = None
    if previous is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not gpu_available():
        pytest.skip("no CUDA GPU")


@pytest.fixture(scope="session")
def run_module():
    """``run_module(module, *args, tmp_path=..., timeout=...)`` runs ``python -m module args``
    from the repository root, as the benchmarks' smoke tests do: without the caller's
    ``ARRAYIO_*`` settings, the dispatcher's table in memory, matplotlib headless with its
    cache under ``tmp_path``; the test fails with the output if the module does."""
    root = Path(__file__).resolve().parents[1]

    def run(
        module: str, *args: str, tmp_path: Path, timeout: float = 240
    ) -> subprocess.CompletedProcess[str]:
        env = {name: value for name, value in os.environ.items() if not name.startswith("ARRAYIO_")}
        env.update(ARRAYIO_CACHE_DIR="none", MPLBACKEND="Agg", MPLCONFIGDIR=str(tmp_path / "mpl"))
        result = subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert result.returncode == 0, f"{module} failed:\n{result.stdout}\n{result.stderr}"
        return result

    return run
