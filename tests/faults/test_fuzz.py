"""Mutation fuzzing of every format arrayio reads (:mod:`arrayio.testing.fuzz`).

The CI campaign runs ``ARRAYIO_FUZZ_CASES`` cases (default 30000) of seed
``ARRAYIO_FUZZ_SEED`` (default 0), stopping after ``ARRAYIO_FUZZ_SECONDS`` (default 75)
whatever is left (a case takes about 4 ms of one core, more for a ``.npy`` header NumPy
parses slowly), and requires zero failures of every kind: no exception other than an
``ArrayioError``, no container arrayio wrote read back differently without an error, no
case over 5 seconds, no child killed by a signal, no memory blow-up. On failure the table
of outcomes is the assertion message; replay a case with
``python -m arrayio.testing.fuzz --replay SEED:N``.

A nightly job runs more, with a new seed each night, e.g.::

    ARRAYIO_FUZZ_CASES=200000 ARRAYIO_FUZZ_SECONDS=3000 ARRAYIO_FUZZ_SEED=$(date +%j) \\
        python -m pytest tests/faults/test_fuzz.py

or the command line, which also writes every failing case: ``python -m
arrayio.testing.fuzz --cases 200000 --seed 17 --json fuzz.json``.

The other tests here check the fuzzer itself: its cases are reproducible, it draws every
kind of mutation for every format, and its runner attributes a child's death, hang or
slowness to the case that caused it.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest

from arrayio.testing import fuzz


def _setting(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


CASES = int(_setting("ARRAYIO_FUZZ_CASES", 30000))
SEED = int(_setting("ARRAYIO_FUZZ_SEED", 0))
SECONDS = _setting("ARRAYIO_FUZZ_SECONDS", 75)


@pytest.mark.slow
@pytest.mark.timeout(max(300, int(SECONDS) + 240))
def test_fuzz_campaign_finds_no_failure(tmp_path: Path) -> None:
    campaign = fuzz.run_campaign(CASES, SEED, seconds=SECONDS, directory=tmp_path)
    table = campaign.table()
    print("\n" + table)
    assert campaign.records, "the campaign ran no case"
    failures = sum(map(len, campaign.failures().values()))
    assert failures == 0, "\n" + table


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[fuzz.Seed], dict[str, bytes]]:
    directory = tmp_path_factory.mktemp("seeds")
    fuzz.write_seeds(directory)
    return fuzz.read_seeds(directory)


def test_seeds_are_small_and_cover_every_format(
    seeds: tuple[list[fuzz.Seed], dict[str, bytes]],
) -> None:
    written, blobs = seeds
    assert {seed.format for seed in written} == {
        "arrayio",
        "arrayio-npy",
        "numpy-npy",
        "safetensors",
    }
    assert all(len(blob) < 16 << 10 for blob in blobs.values()), {
        name: len(blob) for name, blob in blobs.items()
    }


def test_cases_are_reproducible(seeds: tuple[list[fuzz.Seed], dict[str, bytes]]) -> None:
    written, blobs = seeds
    for number in range(0, 400, 7):
        first = fuzz.make_case(f"3:{number}", written, blobs)
        again = fuzz.make_case(f"3:{number}", written, blobs)
        assert (first.seed, first.mutation, first.data) == (again.seed, again.mutation, again.data)
    other = fuzz.make_case("4:0", written, blobs)
    assert (other.mutation, other.data) != (first.mutation, first.data)


def test_every_mutation_is_drawn_for_every_format(
    seeds: tuple[list[fuzz.Seed], dict[str, bytes]],
) -> None:
    written, blobs = seeds
    kinds: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for number in range(1500):
        case = fuzz.make_case(f"0:{number}", written, blobs)
        words = case.mutation.split()
        kinds[case.seed.format][
            " ".join(words[:2]) if words[0] in ("JSON:", ".npy:") else words[0]
        ] += 1
        assert case.data != blobs[case.seed.name] or case.mutation.startswith("JSON"), case.mutation
    for fmt, counts in kinds.items():
        for family in ("flip", "overwrite", "truncate", "append", "header"):
            assert counts[family], f"{fmt}: no {family!r} mutation in 1500 cases: {counts}"
    for fmt in ("arrayio", "safetensors"):
        drawn = {k for k in kinds[fmt] if k.startswith("JSON:")}
        assert {"JSON: set", "JSON: rename", "JSON: drop", "JSON: duplicate"} <= drawn, drawn
    drawn = {k for k in kinds["numpy-npy"] | kinds["arrayio-npy"] if k.startswith(".npy:")}
    assert {
        ".npy: stray",
        ".npy: remove",
        ".npy: shape",
        ".npy: descr",
        ".npy: duplicate",
        ".npy: version",
    } <= drawn, drawn


def test_a_known_silent_change_is_caught(
    seeds: tuple[list[fuzz.Seed], dict[str, bytes]], tmp_path: Path
) -> None:
    """The oracle itself: a load that returns something else counts as a silent change
    for an arrayio container, and as an allowed change for a foreign file."""
    written, _ = seeds
    container = next(seed for seed in written if seed.format == "arrayio")
    foreign = next(seed for seed in written if seed.format == "safetensors")
    ok = fuzz._OpResult("ok", ("dict", [(("str", "w"), ("int", "1"))]))
    changed = fuzz._OpResult("ok", ("dict", []))
    reference = {op: ok for op in fuzz.OPERATIONS}
    results = {**reference, "load": changed}
    for seed, forged, outcome in (
        (container, False, "silent-change"),
        (container, True, "ok-changed"),
        (foreign, False, "ok-changed"),
    ):
        case = fuzz.Case("0:0", seed, "test", b"", False, forged)
        record = fuzz._judge(case, results, reference, 100)
        assert record["outcome"] == outcome, record
        assert record["ops"]["load"] == outcome


def test_only_a_structured_edit_can_forge_a_foreign_file(
    seeds: tuple[list[fuzz.Seed], dict[str, bytes]],
) -> None:
    """A container without arrayio metadata is a valid foreign file, which no checksum in
    the file can tell apart: the allowance goes to JSON edits that leave no arrayio
    metadata, never to byte-level mutations."""
    written, blobs = seeds
    forged = [fuzz.make_case(f"0:{n}", written, blobs) for n in range(3000)]
    forged = [case for case in forged if case.forged_foreign]
    assert forged, "no JSON edit removed the arrayio metadata in 3000 cases"
    assert all(
        case.mutation.startswith("JSON:") and case.seed.format == "arrayio" for case in forged
    ), [case.mutation for case in forged]


@pytest.mark.slow
def test_runner_attributes_deaths_hangs_and_slowness(tmp_path: Path) -> None:
    campaign = fuzz.run_campaign(
        10,
        5,
        workers=1,
        batch=10,
        hang_seconds=2,
        slow_seconds=0.5,
        sabotage={2: "signal", 4: "hang", 6: "slow", 8: "memory"},
        directory=tmp_path,
    )
    by_case = {record["case"]: record for record in campaign.records}
    assert sorted(by_case) == sorted(f"5:{n}" for n in range(10)), sorted(by_case)
    assert "signal" in by_case["5:2"]["failures"], by_case["5:2"]
    assert "SIGSEGV" in by_case["5:2"]["failures"]["signal"]["detail"]
    assert "slow" in by_case["5:4"]["failures"], by_case["5:4"]
    assert "hung" in by_case["5:4"]["failures"]["slow"]["detail"]
    assert "slow" in by_case["5:6"]["failures"], by_case["5:6"]
    assert "memory" in by_case["5:8"]["failures"], by_case["5:8"]
    sabotaged = {"5:2", "5:4", "5:6", "5:8"}
    assert not any(
        set(record["failures"]) & {"signal", "slow", "memory"}
        for case, record in by_case.items()
        if case not in sabotaged
    )
    summary = campaign.summary()
    assert summary["failures"]["signal"]["count"] == 1
    json.dumps(summary)  # what --json writes
