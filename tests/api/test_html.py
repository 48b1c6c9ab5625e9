"""Jupyter's HTML views of a :class:`~arrayio.Reader` and a :class:`~arrayio.DispatchReport`:
well-formed, complete, and escaping every string a file or the environment supplies."""

from __future__ import annotations

import html.parser
from pathlib import Path

import numpy as np
import pytest

import arrayio
from arrayio import tools
from arrayio.api import _html
from arrayio.dispatch.dispatcher import Dispatcher
from arrayio.tools import Availability, Tool

HOSTILE = "<script>alert('x')</script>"


class Parsed(html.parser.HTMLParser):
    """Checks that tags nest and close; collects tags, text, and table rows (with classes)."""

    VOID = {"br", "hr", "img", "meta", "input", "wbr"}

    def __init__(self, markup: str) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.tags: list[str] = []
        self.tables: list[list[list[str]]] = []
        self.row_classes: list[str] = []
        self.text: list[str] = []
        self.feed(markup)
        self.close()
        assert self.stack == [], f"unclosed tags: {self.stack}"

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "table":
            self.tables.append([])
        if tag == "tr":
            self.tables[-1].append([])
            self.row_classes.append(dict(attrs).get("class") or "")
        if tag in ("td", "th"):
            self.tables[-1][-1].append("")
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack}"
        self.stack.pop()

    def handle_data(self, data):
        if "style" not in self.stack:
            self.text.append(data)
        if self.stack and self.stack[-1] in ("td", "th"):
            self.tables[-1][-1][-1] += data

    @property
    def all_text(self) -> str:
        return "".join(self.text)


@pytest.fixture
def container(tmp_path: Path) -> Path:
    path = tmp_path / "c.safetensors"
    arrayio.save(
        path,
        {
            "emb": np.zeros((1000, 16), np.float32),
            "step": 3,
            "layers": [{"w": np.eye(4), "b": np.arange(4, dtype=np.int16)}],
            HOSTILE: np.ones(2, np.uint8),
        },
        metadata={"run": "baseline", "config": {"lr": 0.1}, f"note{HOSTILE}": HOSTILE},
    )
    return path


def test_the_reader_shows_every_array_and_the_metadata(container):
    with arrayio.open(container) as reader:
        parsed = Parsed(reader._repr_html_())
        arrays, metadata = parsed.tables
        header, *rows = arrays
        assert header == ["key", "dtype", "shape", "size", "offset", "crc32c"]
        assert [row[0] for row in rows] == reader.keys()
        for row, key in zip(rows, reader.keys(), strict=True):
            info = reader[key]
            assert row[1] == info.dtype
            assert row[2] == str(info.shape)
            assert row[4] == str(info.file_offset)
            assert row[5] == info.crc32c
        assert rows[0][3] == "62.5 KiB"  # 1000 * 16 * 4 bytes
        assert metadata[0] == ["name", "value"]
        assert dict(map(tuple, metadata[1:])) == {
            "run": "baseline",
            "config": '{"lr": 0.1}',
            f"note{HOSTILE}": HOSTILE,
        }
        assert "checksums: 4 of 4" in parsed.all_text
        assert "saved from numpy" in parsed.all_text


def test_keys_and_metadata_are_escaped(container):
    with arrayio.open(container) as reader:
        markup = reader._repr_html_()
    assert "<script>" not in markup
    parsed = Parsed(markup)
    assert "script" not in parsed.tags
    assert HOSTILE in parsed.all_text  # shown as text, not run


def test_a_path_is_escaped_too(tmp_path):
    directory = tmp_path / "<em>dir"
    directory.mkdir()
    arrayio.save(directory / "x.npy", np.arange(3))
    with arrayio.open(directory / "x.npy") as reader:
        parsed = Parsed(reader._repr_html_())
    assert "em" not in parsed.tags
    assert "<em>dir" in parsed.all_text
    assert "checksums: 0 of 1" in parsed.all_text  # .npy has none
    assert parsed.tables[0][1][5] == "none"


def test_a_closed_reader_still_describes_its_file(container):
    reader = arrayio.open(container)
    reader.close()
    parsed = Parsed(reader._repr_html_())
    assert "(closed)" in parsed.all_text
    assert len(parsed.tables[0]) == 1 + len(reader)


def test_a_file_with_many_arrays_shows_the_first_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(_html, "MAX_ROWS", 5)
    path = tmp_path / "many.safetensors"
    arrayio.save(path, {f"a{i}": np.zeros(1) for i in range(12)})
    with arrayio.open(path) as reader:
        parsed = Parsed(reader._repr_html_())
    assert len(parsed.tables[0]) == 1 + 5
    assert "and 7 more arrays" in parsed.all_text


# --------------------------------------------------------------------------- dispatch table


@pytest.fixture
def tuned(tmp_path: Path, fresh: Dispatcher) -> arrayio.DispatchReport:
    return arrayio.tune(tmp_path, sizes=[2 << 20], caches=["warm"])


def test_the_report_has_a_summary_row_per_context_and_every_arm(tuned):
    parsed = Parsed(tuned._repr_html_())
    summary, *details = parsed.tables
    header, *rows = summary
    assert header == [
        "direction",
        "memory",
        "size",
        "storage",
        "cache",
        "load",
        "crc",
        "phase",
        "chosen",
        "GB/s",
    ]
    explanations = sorted(tuned.explanations, key=lambda e: e.key)
    assert sorted(row[0] for row in rows) == sorted(e.key.split("/")[0] for e in explanations)
    assert {row[8] for row in rows} == {e.chosen for e in explanations}
    assert all(row[2] == "<= 2.0 MiB" and row[6] == "yes" for row in rows)
    assert len(details) == len(explanations)
    arms = sorted((arm.label, arm.state) for e in explanations for arm in e.arms)
    assert sorted((row[0], row[1]) for table in details for row in table[1:]) == arms
    # The chosen arm's row is marked (bold).
    chosen_rows = [row for table in details for row in table[1:] if row[1] == "chosen"]
    assert len(chosen_rows) == parsed.row_classes.count("chosen") == len(explanations)
    for explanation in explanations:
        assert explanation.key in parsed.all_text


def test_the_report_escapes_tool_reasons(monkeypatch, fresh):
    class Unavailable(Tool):
        name = "fake-unavailable"

        @classmethod
        def availability(cls) -> Availability:
            return Availability(False, f"needs <libfake> & {HOSTILE}")

        def pread(self, fd, buffer, file_offset, *, checksum=None):
            raise AssertionError("never used")

        def pwrite(self, fd, buffer, file_offset, *, checksum=None):
            raise AssertionError("never used")

    monkeypatch.setattr(tools, "_REGISTRY", dict(tools._REGISTRY))
    tools.register("fake-unavailable", Unavailable, clobber=True)
    markup = arrayio.explain()._repr_html_()
    parsed = Parsed(markup)
    assert "libfake" not in parsed.tags and "script" not in parsed.tags
    assert f"fake-unavailable (needs <libfake> & {HOSTILE})" in parsed.all_text


def test_an_empty_report_says_nothing_is_learned(fresh):
    parsed = Parsed(arrayio.explain()._repr_html_())
    assert "Nothing learned yet" in parsed.all_text
    assert "in memory only" in parsed.all_text


def test_an_unrecognised_context_key_is_shown_whole():
    from arrayio.dispatch.policy import ArmReport, Explanation

    arm = ArmReport("posix", "chosen", 1.5, 2.0, 1.5, 3, 4, 0)
    report = arrayio.DispatchReport(
        (Explanation(f"future/{HOSTILE}", "exploiting", "posix", "fastest", (arm,)),),
        {"posix": None},
        None,
    )
    parsed = Parsed(report._repr_html_())
    assert parsed.tables[0][1][0] == f"future/{HOSTILE}"
    assert parsed.tables[0][1][9] == "1.50"
    assert "script" not in parsed.tags
