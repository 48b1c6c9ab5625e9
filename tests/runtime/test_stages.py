"""Where a load's time goes (``arrayio.runtime._stages``): the stages of the calling thread's
load, the last load kept for ``arrayio.explain()``."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

import arrayio
from arrayio.runtime import _stages


@pytest.fixture
def no_last(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stages, "_last", None)


def test_a_stage_outside_a_call_records_nothing(no_last: None) -> None:
    with _stages.stage("open"):
        pass
    assert _stages.last() is None and _stages.current() is None


def test_a_call_keeps_its_stages_summed_and_nested(no_last: None) -> None:
    with _stages.calling("load"):
        with _stages.stage("transfers"):
            with _stages.stage("checksums on the GPU"):
                time.sleep(0.01)
        with _stages.stage("transfers"):
            time.sleep(0.01)
        with _stages.calling("load"):  # a load inside another belongs to the outer one
            with _stages.stage("open"):
                pass
    last = _stages.last()
    assert last is not None and last["call"] == "load"
    stages = last["stages"]
    assert list(stages) == ["checksums on the GPU", "transfers", "open"]
    assert stages["transfers"] >= 0.02 > stages["checksums on the GPU"] >= 0.01
    assert last["seconds"] >= stages["transfers"] + stages["open"]
    assert _stages.current() is None


def test_other_threads_record_into_a_call_they_join(no_last: None) -> None:
    with _stages.calling("load"):
        record = _stages.current()

        def work() -> None:
            with _stages.stage("on a thread"):  # not joined: nothing
                pass
            with _stages.joined(record), _stages.stage("transfers"):
                time.sleep(0.01)

        threads = [threading.Thread(target=work) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    stages = _stages.last()["stages"]  # type: ignore[index]
    assert set(stages) == {"transfers"} and stages["transfers"] >= 0.03


def test_a_load_says_where_its_time_went(tmp_path: Path, no_last: None) -> None:
    path = tmp_path / "a.safetensors"
    arrays = {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(4)}
    arrayio.save(path, arrays)
    loaded = arrayio.load(path)
    np.testing.assert_array_equal(loaded["w3"], arrays["w3"])
    last = _stages.last()
    assert last is not None and last["call"] == "load"
    assert {"open", "target", "allocate", "transfers", "finish", "results"} <= set(last["stages"])
    assert "checksums on the GPU" not in last["stages"]  # none on a machine without a GPU
    assert 0 < last["stages"]["transfers"] <= last["seconds"]
    text = str(arrayio.explain())
    assert "  last load: " in text and "transfers" in text
    assert arrayio.explain().as_dict()["last_load"]["stages"].keys() == last["stages"].keys()
    assert "last load: " in arrayio.explain()._repr_html_()  # and in Jupyter


def test_a_checkpoint_in_files_is_one_load(tmp_path: Path, no_last: None) -> None:
    arrays = {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(4)}
    arrayio.save(tmp_path / "ckpt", arrays, max_shard_size="2M")
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) > 1
    arrayio.load(tmp_path / "ckpt")
    last = _stages.last()
    assert last is not None and {"open", "transfers"} <= set(last["stages"])


def test_a_failed_load_is_still_the_last(tmp_path: Path, no_last: None) -> None:
    with pytest.raises(FileNotFoundError):
        arrayio.load(tmp_path / "missing.safetensors")
    last = _stages.last()
    assert last is not None and last["seconds"] is not None
