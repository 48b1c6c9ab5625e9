"""Shared fixtures: ``xp`` runs a test once per framework (and device) that is installed.

GPU cases carry the ``gpu`` marker and are skipped, at run time rather than collection time,
where no CUDA device is usable; a missing framework skips only its own cases.
"""

from __future__ import annotations

import os
import subprocess
import sys
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


def pytest_configure(config: pytest.Config) -> None:
    # What the dispatcher learns during the tests stays in a scratch directory, never in the
    # user's ~/.cache/arrayio.
    import tempfile

    import arrayio
    from arrayio.dispatch import dispatcher

    arrayio.config.set(cache_dir=tempfile.mkdtemp(prefix="arrayio-test-cache-"))
    dispatcher.reset()


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

    def run(module: str, *args: str, tmp_path: Path, timeout: float = 240
            ) -> subprocess.CompletedProcess[str]:
        env = {name: value for name, value in os.environ.items()
               if not name.startswith("ARRAYIO_")}
        env.update(ARRAYIO_CACHE_DIR="none", MPLBACKEND="Agg",
                   MPLCONFIGDIR=str(tmp_path / "mpl"))
        result = subprocess.run([sys.executable, "-m", module, *args], cwd=root, env=env,
                                capture_output=True, text=True, timeout=timeout, check=False)
        assert result.returncode == 0, f"{module} failed:\n{result.stdout}\n{result.stderr}"
        return result

    return run
