"""Shared fixtures: ``xp`` runs a test once per framework (and device) that is installed.

GPU cases carry the ``gpu`` marker and are skipped, at run time rather than collection time,
where no CUDA device is usable; a missing framework skips only its own cases.
"""

from __future__ import annotations

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
