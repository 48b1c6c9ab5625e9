"""Background work the exit waits for (``arrayio.runtime._background``)."""

from __future__ import annotations

import threading

from arrayio.runtime import _background


def test_nothing_starts_once_the_exit_has_begun(monkeypatch):
    # A set-up decided just as the process exits would race its teardown: it does not start.
    exit_begun = threading.Event()
    exit_begun.set()
    monkeypatch.setattr(_background, "_exit", exit_begun)
    ran = threading.Event()
    thread = _background.start(ran.set, name="late")
    assert thread.ident is None and not ran.is_set() and _background.exiting()


def test_an_idle_wait_ends_when_the_exit_begins(monkeypatch):
    exit_begun = threading.Event()
    monkeypatch.setattr(_background, "_exit", exit_begun)
    done = threading.Event()
    _background.start_untracked(lambda: (_background.sleep(3600), done.set()), name="waiting")
    exit_begun.set()
    assert done.wait(5)
