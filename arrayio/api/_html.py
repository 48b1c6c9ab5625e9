"""HTML for Jupyter: what a file holds (:class:`~arrayio.Reader`) and what the dispatcher
learned (:class:`~arrayio.DispatchReport`).

Every string that comes from a file or from the environment (keys, metadata, paths, error
messages) is escaped: a file is untrusted input, and a notebook renders what we return.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..runtime._units import format_bytes, format_count

if TYPE_CHECKING:
    from ..dispatch.policy import Explanation
    from ._reader import Reader
    from ._tuning import DispatchReport

__all__ = ["dispatch_report_html", "reader_html"]

MAX_ROWS = 200  # a file with thousands of arrays shows the first ones and a count

_STYLE = (
    "<style>.arrayio-repr table{border-collapse:collapse;margin:4px 0}"
    ".arrayio-repr th,.arrayio-repr td{padding:2px 8px;text-align:left;"
    "border-bottom:1px solid #ddd;font-family:monospace}"
    ".arrayio-repr td.num{text-align:right}"
    ".arrayio-repr tr.chosen td{font-weight:bold}</style>"
)


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _table(
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    numeric: frozenset[int] = frozenset(),
    row_classes: Sequence[str] | None = None,
) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cells = "".join(
            f'<td class="num">{_e(c)}</td>' if j in numeric else f"<td>{_e(c)}</td>"
            for j, c in enumerate(row)
        )
        css = f' class="{_e(row_classes[i])}"' if row_classes and row_classes[i] else ""
        body.append(f"<tr{css}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _metadata_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 200 else text[:197] + "..."


def reader_html(reader: Reader) -> str:
    """An HTML summary of an open (or closed) :class:`~arrayio.Reader`: one row per array
    (key, dtype, shape, size, file offset, CRC-32C), then the metadata."""
    keys = reader.keys()
    with_crc = sum(reader[k].crc32c is not None for k in keys)
    framework = f", saved from {reader.framework}" if reader.framework else ""
    state = " (closed)" if reader.closed else ""
    title = (
        f"<b>arrayio.Reader</b> <code>{_e(reader.path)}</code>{state}<br>"
        f"{_e(reader.format)}, {format_count(len(keys), 'array')}, "
        f"{_e(format_bytes(reader.nbytes))}"
        f"{_e(framework)}; checksums: {with_crc} of {len(keys)}"
    )
    rows = []
    for key in keys[:MAX_ROWS]:
        info = reader[key]
        rows.append(
            (
                key,
                info.dtype,
                "(" + ", ".join(map(str, info.shape)) + ("," if len(info.shape) == 1 else "") + ")",
                format_bytes(info.nbytes),
                info.file_offset,
                info.crc32c or "none",
            )
        )
    parts = [
        _STYLE,
        '<div class="arrayio-repr">',
        title,
        _table(
            ("key", "dtype", "shape", "size", "offset", "crc32c"), rows, numeric=frozenset({3, 4})
        ),
    ]
    if len(keys) > MAX_ROWS:
        parts.append(f"<i>... and {format_count(len(keys) - MAX_ROWS, 'more array')}</i>")
    if reader.metadata:
        parts.append("<b>metadata</b>")
        parts.append(
            _table(
                ("name", "value"),
                ((name, _metadata_value(value)) for name, value in reader.metadata.items()),
            )
        )
    parts.append("</div>")
    return "".join(parts)


_KEY = re.compile(r"^(read|write)/(\w+)/2\^(\d+)/([^/]*)/([^/]*)/x(\d+)(/crc)?$")


def _context_columns(key: str) -> tuple[str, ...] | None:
    """direction, memory, size, storage, cache, load, checksum from a context key."""
    match = _KEY.match(key)
    if match is None:
        return None
    direction, memory, power, storage, cache, load, crc = match.groups()
    return (
        direction,
        memory,
        "<= " + format_bytes(1 << int(power)),
        storage,
        cache,
        load,
        "yes" if crc else "no",
    )


def _sort_key(explanation: Explanation) -> tuple[Any, ...]:
    match = _KEY.match(explanation.key)
    if match is None:
        return (1, explanation.key)
    direction, memory, power, storage, cache, load, crc = match.groups()
    return (0, direction, memory, storage, cache, int(load), crc or "", int(power))


def _gbps(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def dispatch_report_html(report: DispatchReport) -> str:
    """An HTML view of a :class:`~arrayio.DispatchReport`: the tools, one summary row per
    context (what it chose and how fast), and each context's arms in a collapsible table."""
    available = [name for name, reason in report.tools.items() if reason is None]
    unavailable = [
        f"{name} ({reason})" for name, reason in report.tools.items() if reason is not None
    ]
    parts = [
        _STYLE,
        '<div class="arrayio-repr">',
        f"<b>arrayio dispatch table</b> <code>{_e(report.table_path or 'in memory only')}"
        f"</code><br>tools available: {_e(', '.join(available) or 'none')}",
    ]
    if unavailable:
        parts.append(f"<br>unavailable: {_e('; '.join(unavailable))}")
    if report.last_load is not None:
        from ._tuning import stages_text

        parts.append(f"<br>last load: {_e(stages_text(report.last_load))}")
    for record in report.set_ups:
        from ._tuning import set_up_text

        parts.append(f"<br>set up in the background: {_e(set_up_text(record))}")
    explanations = sorted(report.explanations, key=_sort_key)
    if not explanations:
        parts.append(
            "<p>Nothing learned yet: transfers (or <code>arrayio.tune</code>) teach it.</p></div>"
        )
        return "".join(parts)
    summary = []
    for explanation in explanations:
        columns = _context_columns(explanation.key) or (explanation.key, "", "", "", "", "", "")
        chosen = next((arm for arm in explanation.arms if arm.label == explanation.chosen), None)
        summary.append(
            (
                *columns,
                explanation.phase,
                explanation.chosen or "-",
                _gbps(chosen.gbps if chosen is not None else None),
            )
        )
    parts.append(
        _table(
            (
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
            ),
            summary,
            numeric=frozenset({9}),
        )
    )
    for explanation in explanations:
        rows = [
            (
                arm.label,
                arm.state,
                _gbps(arm.gbps),
                _gbps(arm.best_gbps),
                arm.samples,
                arm.count,
                arm.failures,
                arm.reason or "",
            )
            for arm in explanation.arms
        ]
        classes = ["chosen" if arm.state == "chosen" else "" for arm in explanation.arms]
        parts.append(
            f"<details><summary><code>{_e(explanation.key)}</code>: "
            f"{_e(explanation.chosen or '-')} [{_e(explanation.reason)}]</summary>"
            + (f"<p>page cache: {_e(explanation.rule)}</p>" if explanation.rule else "")
            + _table(
                ("arm", "state", "GB/s", "best GB/s", "samples", "calls", "failures", "note"),
                rows,
                numeric=frozenset({2, 3, 4, 5, 6}),
                row_classes=classes,
            )
            + "</details>"
        )
    parts.append("</div>")
    return "".join(parts)
