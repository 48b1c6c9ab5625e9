"""The learning policy, on fake tools that advance a fake clock: nothing here does real I/O.

A :class:`World` holds the simulated machine: the speed of every arm (bytes per second, or a
function of the call size), which calls fail and how, and one clock per thread that a fake
tool advances by ``nbytes / speed`` when it "moves" bytes, so that concurrent threads each
measure exactly their own simulated time.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrayio.tools
from arrayio.dispatch import Arm, Policy, Table, is_tool_failure
from arrayio.dispatch.context import Context
from arrayio.dispatch.policy import PREPARE_AFTER
from arrayio.dispatch.table import EXPLOITING, EXPLORING
from arrayio.errors import (
    ChecksumError,
    FormatError,
    HeaderTooLargeError,
    ToolUnavailableError,
    TruncatedFileError,
    UnknownToolError,
)
from arrayio.tools import Availability, Capabilities, IOFuture, Tool

GB = 1e9
MiB = 1 << 20
WALL = 1_700_000_000.0

Speed = float | Callable[[int], float]


class World:
    """The simulated machine; see the module docstring."""

    def __init__(self, speeds: dict[str, Speed]) -> None:
        self.speeds = dict(speeds)
        self.calls: collections.Counter[str] = collections.Counter()
        self.failures: dict[str, tuple[Callable[[], BaseException], set[int] | None]] = {}
        self.wall = WALL
        self._local = threading.local()
        self._lock = threading.Lock()

    def clock(self) -> float:
        return getattr(self._local, "now", 0.0)

    def wall_clock(self) -> float:
        return self.wall

    def fail(
        self, label: str, error: Callable[[], BaseException], calls: set[int] | None = None
    ) -> None:
        """Make ``label`` raise ``error()`` on the given call numbers (1-based), or always."""
        self.failures[label] = (error, calls)

    def heal(self, label: str) -> None:
        self.failures.pop(label, None)

    def make(self, arm: Arm) -> FakeTool:
        return FakeTool(self, arm)

    def transfer(self, label: str, nbytes: int) -> int:
        with self._lock:
            self.calls[label] += 1
            call = self.calls[label]
            failure = self.failures.get(label)
            speed = self.speeds[label]
        if failure is not None and (failure[1] is None or call in failure[1]):
            raise failure[0]()
        rate = speed(nbytes) if callable(speed) else speed
        self._local.now = self.clock() + nbytes / rate
        return nbytes


class FakeTool(Tool):
    """A tool whose transfers only advance the world's clock."""

    capabilities = Capabilities(frozenset({"host", "cuda"}))

    def __init__(self, world: World, arm: Arm) -> None:
        super().__init__(**dict(arm.params))
        self.name = arm.name
        self.world = world
        self.closed = False

    def transfer(self, nbytes: int) -> int:
        return self.world.transfer(self.label, nbytes)

    def pread(self, fd, buffer, file_offset, *, checksum=None):
        return IOFuture.completed(self.transfer(buffer.nbytes))

    def pwrite(self, fd, buffer, file_offset, *, checksum=None):
        return IOFuture.completed(self.transfer(buffer.nbytes))

    def close(self) -> None:
        self.closed = True


def context(
    size_class: int = 20,
    *,
    direction: str = "read",
    memory: str = "host",
    storage: str = "vda",
    cache: str = "warm",
    load: int = 1,
) -> Context:
    return Context(direction, memory, size_class, storage, cache, load)


def make_policy(
    world: World,
    arms: list[Arm] | Callable[[Context], list[Arm]],
    table: Table | None = None,
    **tunables,
) -> Policy:
    candidates = arms if callable(arms) else (lambda _context: list(arms))
    table = table if table is not None else Table(clock=world.wall_clock)
    tunables.setdefault("skip_first_call", False)  # fake tools have no setup cost
    # Extra samples for close contenders are tested on their own; elsewhere, off.
    tunables.setdefault("contend_samples", tunables.get("explore_samples", 2))
    return Policy(candidates, table, clock=world.clock, make=world.make, **tunables)


def call(policy: Policy, ctx: Context, nbytes: int = MiB, **kwargs) -> Arm:
    result, arm = policy.run(ctx, nbytes, lambda tool: tool.transfer(nbytes), **kwargs)
    assert result == nbytes
    return arm


def labels(policy: Policy, ctx: Context, count: int, nbytes: int = MiB) -> list[str]:
    return [call(policy, ctx, nbytes).label for _ in range(count)]


def entry_of(policy: Policy, ctx: Context):
    with policy.table.lock:
        return policy.table.get(ctx.key())


A, B, C, D, E = (Arm(name) for name in "abcde")


# -- arms -------------------------------------------------------------------------------------


def test_arm_labels_match_tool_labels():
    arm = Arm.of("posix", threads=16, task_size=8 << 20)
    tool = arrayio.tools.make("posix", threads=16, task_size=8 << 20)
    try:
        assert arm.label == tool.label == "posix(task_size=8388608,threads=16)"
        assert Arm.from_tool(tool) == arm
    finally:
        tool.close()
    assert Arm("naive").label == arrayio.tools.make("naive").label == "naive"
    assert str(arm) == arm.label


def test_arms_are_values():
    unsorted = Arm("posix", (("threads", 16), ("task_size", 1)))
    assert (
        unsorted
        == Arm("posix", {"task_size": 1, "threads": 16})
        == Arm.of("posix", threads=16, task_size=1)
    )
    assert unsorted.params == (("task_size", 1), ("threads", 16))
    assert len({unsorted, Arm.of("posix", task_size=1, threads=16)}) == 1
    with pytest.raises(ValueError, match="repeated"):
        Arm("posix", (("threads", 1), ("threads", 2)))


def test_the_default_make_uses_the_registry(monkeypatch):
    world = World({"dispatch-test-fake(speed=1)": 1 * GB})

    class Registered(FakeTool):
        def __init__(self, **params) -> None:
            super().__init__(world, Arm("dispatch-test-fake", params))

    monkeypatch.setattr(arrayio.tools, "_REGISTRY", dict(arrayio.tools._REGISTRY))
    arrayio.tools.register("dispatch-test-fake", Registered, clobber=True)
    arm = Arm.of("dispatch-test-fake", speed=1)
    policy = Policy(lambda _context: [arm], clock=world.clock, skip_first_call=False)
    assert call(policy, context()) == arm
    tool = policy.tool(arm)
    assert isinstance(tool, Registered) and tool.label == arm.label
    assert policy.tool(arm) is tool  # one instance per arm: tools hold pools and buffers
    policy.close()
    assert tool.closed
    assert policy.tool(arm) is not tool


# -- exploring and exploiting -----------------------------------------------------------------


def test_close_contenders_get_more_samples_before_the_choice():
    # a and b within 15% of each other: 4 samples each. d between the pruning bar and the
    # contenders' one: the usual 2. c below half the best: pruned after one.
    world = World({"a": 3 * GB, "b": 2.8 * GB, "c": 1 * GB, "d": 2 * GB})
    policy = make_policy(world, [A, B, C, D], contend_samples=4, contend_ratio=0.85)
    ctx = context()
    assert labels(policy, ctx, 11) == ["a", "b", "c", "d", "a", "b", "d", "a", "b", "a", "b"]
    assert entry_of(policy, ctx).phase == EXPLOITING
    assert labels(policy, ctx, 3) == ["a"] * 3
    report = {arm.label: arm for arm in policy.explain(ctx).arms}
    assert [report[x].samples for x in "abcd"] == [7, 4, 1, 2]


def test_a_contender_appearing_while_exploiting_does_not_reopen_exploration():
    # b is outside the band (2/3 of a) and gets its 2 samples. Then a slows to 2.2, not
    # enough to count as drift: b is now within 15% of a's estimate, but the context keeps
    # exploiting a (and so does a new policy loading the same table).
    world = World({"a": 3 * GB, "b": 2 * GB})
    table = Table(clock=world.wall_clock)
    policy = make_policy(world, [A, B], table, contend_samples=4, contend_ratio=0.85)
    ctx = context()
    assert labels(policy, ctx, 4) == ["a", "b", "a", "b"]
    world.speeds["a"] = 2.2 * GB
    assert labels(policy, ctx, 12) == ["a"] * 12
    assert entry_of(policy, ctx).phase == EXPLOITING
    reloaded = make_policy(
        world,
        [A, B],
        Table.from_json(json.loads(table.dumps()), clock=world.wall_clock),
        contend_samples=4,
        contend_ratio=0.85,
    )
    assert labels(reloaded, ctx, 3) == ["a"] * 3


def test_policy_defaults_give_close_arms_four_samples():
    policy = Policy(lambda _context: [A])
    assert (policy.explore_samples, policy.contend_samples, policy.contend_ratio) == (2, 4, 0.85)


def test_exploration_visits_every_arm_in_rounds_then_exploits_the_fastest():
    world = World({"a": 2 * GB, "b": 3 * GB, "c": 2.5 * GB})
    policy = make_policy(world, [A, B, C])
    ctx = context()
    assert labels(policy, ctx, 6) == ["a", "b", "c", "a", "b", "c"]
    assert entry_of(policy, ctx).phase == EXPLOITING
    assert labels(policy, ctx, 5) == ["b"] * 5
    explanation = policy.explain(ctx)
    assert (explanation.phase, explanation.chosen) == (EXPLOITING, "b")
    assert explanation.reason == "fastest of 3 measured"
    report = {arm.label: arm for arm in explanation.arms}
    assert report["a"].gbps == pytest.approx(2.0)
    assert report["b"].samples == 7 and report["b"].state == "chosen"
    assert report["c"].state == "measured"


def test_one_sample_each_when_asked():
    world = World({"a": 2 * GB, "b": 3 * GB, "c": 2.5 * GB})
    policy = make_policy(world, [A, B, C], explore_samples=1)
    assert labels(policy, context(), 5) == ["a", "b", "c", "b", "b"]


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ([A, B, C], ["a", "b", "c", "a", "c", "a", "a"]),
        ([B, A, C], ["b", "a", "c", "a", "c", "a", "a"]),  # b is pruned once a is measured
    ],
)
def test_an_arm_far_below_the_best_gets_one_sample(order, expected):
    world = World({"a": 10 * GB, "b": 1 * GB, "c": 9 * GB})
    policy = make_policy(world, order)
    ctx = context()
    assert labels(policy, ctx, len(expected)) == expected
    assert world.calls["b"] == 1
    states = {arm.label: arm.state for arm in policy.explain(ctx).arms}
    assert states == {"a": "chosen", "b": "pruned", "c": "measured"}


def test_exploration_overhead_is_bounded():
    # The worst prior order: slowest first. Pruning keeps the slow arms to one call each.
    speeds = {"a": 1 * GB, "b": 2 * GB, "c": 5 * GB, "d": 8 * GB, "e": 10 * GB}
    calls, nbytes = 200, 64 * MiB
    best_only = calls * nbytes / speeds["e"]

    def total(**tunables) -> float:
        world = World(speeds)
        policy = make_policy(world, [A, B, C, D, E], **tunables)
        assert labels(policy, context(26), calls, nbytes)[-1] == "e"
        return world.clock()

    pruned, unpruned = total(), total(prune_ratio=0)
    assert pruned <= 1.1 * best_only
    assert pruned < unpruned <= 1.2 * best_only


@settings(max_examples=60, deadline=None)
@given(
    speeds=st.lists(st.floats(0.05, 50), min_size=1, max_size=6),
    explore_samples=st.integers(1, 3),
    prune_ratio=st.sampled_from([0.0, 0.5, 0.9]),
)
def test_after_exploration_the_fastest_arm_is_chosen(speeds, explore_samples, prune_ratio):
    arms = [Arm.of("t", i=i) for i in range(len(speeds))]
    world = World({arm.label: speed * GB for arm, speed in zip(arms, speeds, strict=True)})
    policy = make_policy(world, arms, explore_samples=explore_samples, prune_ratio=prune_ratio)
    ctx = context()
    exploring_calls = 0
    while entry_of(policy, ctx) is None or entry_of(policy, ctx).phase == EXPLORING:
        call(policy, ctx)
        exploring_calls += 1
        assert exploring_calls <= len(arms) * explore_samples
    assert set(world.calls) == {arm.label for arm in arms}  # every arm measured
    assert max(world.calls.values()) <= explore_samples
    chosen = call(policy, ctx)
    assert world.speeds[chosen.label] >= max(world.speeds.values()) * (1 - 1e-9)


def test_calls_under_way_explore_different_arms():
    world = World({"a": 2 * GB, "b": 3 * GB})
    policy = make_policy(world, [A, B], explore_samples=1)
    ctx = context()
    seen = []

    def outer(tool: Tool) -> int:
        seen.append(tool.label)
        seen.append(call(policy, ctx).label)  # a second call while the first is measuring
        return tool.transfer(MiB)

    policy.run(ctx, MiB, outer)
    assert seen == ["a", "b"]


def test_small_calls_are_summed_into_one_sample():
    world = World({"a": 2 * GB, "b": 3 * GB})
    policy = make_policy(world, [A, B], explore_samples=1, min_bytes_to_learn=64 << 10)
    ctx = context(12)
    assert labels(policy, ctx, 34, nbytes=4096) == ["a"] * 16 + ["b"] * 16 + ["b"] * 2
    entry = entry_of(policy, ctx)
    assert entry.arms["a"].count == 1
    assert entry.arms["a"].estimate == pytest.approx(2 * GB)


def test_calls_of_no_bytes_teach_nothing():
    world = World({"a": 2 * GB, "b": 3 * GB})
    policy = make_policy(world, [A, B])
    ctx = context(0)
    policy.record(ctx, A, 0, 1.0)
    assert entry_of(policy, ctx) is None
    assert labels(policy, ctx, 3, nbytes=0) == ["a"] * 3
    assert entry_of(policy, ctx).arms == {}


def test_a_new_candidate_is_explored_without_measuring_the_others_again():
    world = World({"a": 2 * GB, "b": 3 * GB, "c": 5 * GB})
    table = Table(clock=world.wall_clock)
    ctx = context()
    labels(make_policy(world, [A, B], table), ctx, 4)
    world.calls.clear()
    assert labels(make_policy(world, [A, B, C], table), ctx, 4) == ["c", "c", "c", "c"]


def test_explain_does_not_change_anything():
    world = World({"a": 4 * GB, "b": 3 * GB, "c": 5 * GB})
    policy = make_policy(world, [A, B, C])
    ctx = context()
    explanation = policy.explain(ctx)
    assert (explanation.phase, explanation.chosen) == (EXPLORING, "a")
    assert explanation.reason == "exploring: 3 arms left"
    assert [arm.state for arm in explanation.arms] == ["unmeasured"] * 3
    assert ctx.key() not in policy.table
    labels(policy, ctx, 4)  # a has both its samples; b and c one each
    # A dispatcher's call goes to the best so far (c), b measured on a share of it.
    explained = policy.explain(ctx)
    assert explained.reason == (
        "exploring: 2 arms left; b measured on a share of each call, c moving the rest"
    )
    assert explained.chosen == "c"
    with policy.whole_calls():  # tune(): the whole next call measures b
        assert policy.explain(ctx).reason == "exploring: 2 arms left"
        assert policy.explain(ctx).chosen == "b"
    data = policy.explain(ctx).as_dict()
    assert data["key"] == ctx.key() and isinstance(data["arms"], list)
    assert data["arms"][0]["label"] == "a"


# -- seeding from the nearest learned context -------------------------------------------------


def small_is_c(nbytes: int) -> float:
    return 9 * GB if nbytes <= MiB else 1 * GB


def test_a_new_context_is_seeded_with_its_nearest_neighbours_winner():
    world = World({"a": 2 * GB, "b": lambda n: 3 * GB if n <= MiB else 10 * GB, "c": small_is_c})
    policy = make_policy(world, [A, B, C])
    labels(policy, context(16), 6, nbytes=64 << 10)  # c wins small calls
    labels(policy, context(24), 6, nbytes=16 * MiB)  # b wins large ones
    assert policy.explain(context(16)).chosen == "c"
    assert policy.explain(context(24)).chosen == "b"

    assert call(policy, context(22), 4 * MiB) == B
    assert call(policy, context(17), 128 << 10) == C
    assert call(policy, context(24, load=2), 16 * MiB) == B  # same size, other load
    assert call(policy, context(24, storage="nvme0n1"), 16 * MiB) == A  # nothing alike
    assert call(policy, context(24, direction="write"), 16 * MiB) == A
    explanation = policy.explain(context(22))
    assert explanation.seed == "b"
    assert explanation.reason.endswith("seeded with b")
    assert [arm.label for arm in explanation.arms] == ["b", "a", "c"]


def test_the_nearest_size_wins_over_the_same_load():
    world = World({"a": 2 * GB, "b": 5 * GB, "c": small_is_c})
    policy = make_policy(world, [A, B, C])
    labels(policy, context(20, load=4), 6)  # c wins (1 MiB calls)
    labels(policy, context(26), 6, nbytes=64 * MiB)  # b wins
    assert call(policy, context(21)) == C


# -- drift ------------------------------------------------------------------------------------


def test_a_lasting_slowdown_reexplores_and_converges_to_the_new_best():
    world = World({"a": 10 * GB, "b": 6 * GB})
    policy = make_policy(world, [A, B])
    ctx = context()
    assert labels(policy, ctx, 5) == ["a", "b", "a", "b", "a"]
    world.speeds["a"] = 2 * GB
    assert labels(policy, ctx, 2) == ["a", "a"]
    assert (entry_of(policy, ctx).phase, entry_of(policy, ctx).drift) == (EXPLOITING, 2)
    assert labels(policy, ctx, 1) == ["a"]  # the third in a row: re-explore
    entry = entry_of(policy, ctx)
    assert (entry.phase, entry.reexplorations) == (EXPLORING, 1)
    assert policy.explain(ctx).reason == "exploring: 2 arms left (re-exploration 1)"
    assert labels(policy, ctx, 5) == ["a", "b", "b", "b", "b"]  # a is pruned at 2 GB/s
    assert policy.explain(ctx).chosen == "b"
    assert entry_of(policy, ctx).arms["a"].count == 7  # history is kept


def test_a_short_slowdown_does_not_reexplore():
    world = World({"a": 10 * GB, "b": 6 * GB})
    policy = make_policy(world, [A, B])
    ctx = context()
    labels(policy, ctx, 4)
    world.speeds["a"] = 2 * GB
    assert labels(policy, ctx, 2) == ["a", "a"]
    world.speeds["a"] = 10 * GB
    assert labels(policy, ctx, 3) == ["a", "a", "a"]
    entry = entry_of(policy, ctx)
    assert (entry.phase, entry.reexplorations, entry.drift, entry.held) == (EXPLOITING, 0, 0, [])
    assert entry.arms["a"].samples == 7  # the slow samples were real: admitted at the end
    assert entry.arms["a"].estimate == pytest.approx(10 * GB)


def test_a_winner_that_becomes_faster_is_not_drifting():
    world = World({"a": 10 * GB, "b": 6 * GB})
    policy = make_policy(world, [A, B])
    ctx = context()
    labels(policy, ctx, 4)
    world.speeds["a"] = 40 * GB
    assert labels(policy, ctx, 10) == ["a"] * 10
    assert entry_of(policy, ctx).reexplorations == 0


# -- failures ---------------------------------------------------------------------------------


def einval() -> OSError:
    return OSError(errno.EINVAL, "Invalid argument")


def test_a_failing_tool_is_marked_and_the_call_falls_back():
    world = World({"a": 10 * GB, "b": 5 * GB, "c": 4 * GB})
    world.fail("a", einval, calls={1})
    policy = make_policy(world, [A, B, C])
    ctx = context()
    assert call(policy, ctx) == B
    assert labels(policy, ctx, 10) == ["c", "b", "c", "b", "b", "b", "b", "b", "b", "b"]
    assert world.calls["a"] == 1
    explanation = policy.explain(ctx)
    assert explanation.chosen == "b"
    assert explanation.unavailable == {"a": "OSError: [Errno 22] Invalid argument"}
    [report] = [arm for arm in explanation.arms if arm.label == "a"]
    assert (report.state, report.failures) == ("unavailable", 1)
    # Other contexts still use it.
    assert call(policy, context(20, storage="nvme0n1")) == A


def test_losing_the_winner_reexplores_the_others():
    world = World({"a": 10 * GB, "b": 5 * GB, "c": 6 * GB})
    policy = make_policy(world, [A, B, C])
    ctx = context()
    assert labels(policy, ctx, 7)[-1] == "a"
    world.fail("a", lambda: RuntimeError("cuFile: driver gone"))
    assert call(policy, ctx) == B
    entry = entry_of(policy, ctx)
    assert (entry.phase, entry.reexplorations) == (EXPLORING, 1)
    assert labels(policy, ctx, 5) == ["c", "b", "c", "c", "c"]
    assert policy.explain(ctx).unavailable == {"a": "RuntimeError: cuFile: driver gone"}


TOOL_FAILURES = {
    "ToolUnavailableError": lambda: ToolUnavailableError("O_DIRECT refused by tmpfs"),
    "EINVAL": einval,
    "EIO": lambda: OSError(errno.EIO, "Input/output error"),
    "RuntimeError": lambda: RuntimeError("CUDA error 700"),
    "ImportError": lambda: ImportError("no module named kvikio"),
    "TypeError": lambda: TypeError("reads into host memory only"),
    "UnknownToolError": lambda: UnknownToolError("no transfer tool named 'gone'"),
    "a bug": lambda: AttributeError("'NoneType' object has no attribute 'fd'"),
}


@pytest.mark.parametrize("error", TOOL_FAILURES.values(), ids=TOOL_FAILURES.keys())
def test_tool_failures_fall_back(error):
    world = World({"a": 10 * GB, "b": 5 * GB})
    world.fail("a", error)
    policy = make_policy(world, [A, B])
    ctx = context()
    assert call(policy, ctx) == B
    instance = error()
    assert is_tool_failure(instance)
    assert policy.explain(ctx).unavailable == {"a": f"{type(instance).__name__}: {instance}"}


DATA_ERRORS = {
    "ChecksumError": lambda: ChecksumError("w: CRC-32C mismatch"),
    "TruncatedFileError": lambda: TruncatedFileError("file ends at byte 10"),
    "FormatError": lambda: FormatError("bad header"),
    "HeaderTooLargeError": lambda: HeaderTooLargeError("header of 1 TB"),
    "MemoryError": MemoryError,
    "KeyboardInterrupt": KeyboardInterrupt,
    "ENOSPC": lambda: OSError(errno.ENOSPC, "No space left on device"),
    "EROFS": lambda: OSError(errno.EROFS, "Read-only file system"),
}


@pytest.mark.parametrize("error", DATA_ERRORS.values(), ids=DATA_ERRORS.keys())
def test_data_errors_propagate_without_marking(error):
    world = World({"a": 10 * GB, "b": 5 * GB})
    world.fail("a", error, calls={1})
    policy = make_policy(world, [A, B])
    ctx = context()
    with pytest.raises(type(error())):
        call(policy, ctx)
    assert not is_tool_failure(error())
    assert world.calls == {"a": 1}
    assert policy.explain(ctx).unavailable == {}
    assert call(policy, ctx) == A
    assert policy._in_flight == {}


def test_when_every_arm_fails_the_last_error_is_raised_chained_and_nothing_stays_marked():
    world = World({"a": 10 * GB, "b": 5 * GB, "c": 4 * GB})

    def with_own_context() -> OSError:
        error = OSError(errno.EIO, "a: Input/output error")
        error.__context__ = ValueError("inside a")
        return error

    world.fail("a", with_own_context)
    world.fail("b", lambda: RuntimeError("b: CUDA error"))
    world.fail("c", lambda: TypeError("c: refuses the buffer"))
    policy = make_policy(world, [A, B, C])
    ctx = context()
    with pytest.raises(TypeError, match="c: refuses") as raised:
        call(policy, ctx)
    chain, error = [], raised.value
    while error is not None:
        chain.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    assert chain == [
        "TypeError: c: refuses the buffer",
        "RuntimeError: b: CUDA error",
        "OSError: [Errno 5] a: Input/output error",
        "ValueError: inside a",
    ]
    if hasattr(raised.value, "__notes__"):
        assert "every transfer tool failed" in raised.value.__notes__[-1]
    # When everything fails the tools are rarely to blame: nothing stays marked...
    assert policy.explain(ctx).unavailable == {}
    assert [arm.failures for arm in policy.explain(ctx).arms] == [1, 1, 1]
    # ...so the context recovers with the environment.
    for label in "abc":
        world.heal(label)
    assert call(policy, ctx) == A


def test_the_same_error_object_from_several_tools_does_not_loop():
    shared = RuntimeError("shared")
    world = World({"a": 10 * GB, "b": 5 * GB})
    world.fail("a", lambda: shared)
    world.fail("b", lambda: shared)
    policy = make_policy(world, [A, B])
    with pytest.raises(RuntimeError, match="shared"):
        call(policy, context())


def test_a_tool_that_cannot_be_made_or_cannot_run_here_is_a_failure():
    world = World({"a": 10 * GB, "b": 5 * GB, "c": 4 * GB})

    class Unavailable(FakeTool):
        @classmethod
        def availability(cls) -> Availability:
            return Availability(False, "no libcufile")

    def make(arm: Arm) -> Tool:
        if arm == A:
            raise ImportError("kvikio is not installed")
        if arm == B:
            return Unavailable(world, arm)
        return world.make(arm)

    policy = Policy(
        lambda _context: [A, B, C], Table(), clock=world.clock, make=make, skip_first_call=False
    )
    ctx = context()
    assert call(policy, ctx) == C
    assert policy.explain(ctx).unavailable == {
        "a": "ImportError: kvikio is not installed",
        "b": "ToolUnavailableError: b cannot run here: no libcufile",
    }


def test_without_any_available_arm_the_error_says_why():
    world = World({"a": 10 * GB})
    policy = make_policy(world, [A])
    ctx = context()
    policy.fail(ctx, A, einval())
    with pytest.raises(ToolUnavailableError, match=r"a: OSError: \[Errno 22\]"):
        call(policy, ctx)
    with pytest.raises(ToolUnavailableError):
        policy.choose(ctx)
    assert policy.explain(ctx).reason == "no transfer tool available"
    with pytest.raises(ToolUnavailableError, match="no transfer tool is a candidate"):
        call(make_policy(world, []), ctx)


def test_unavailable_marks_expire():
    world = World({"a": 10 * GB, "b": 5 * GB})
    world.fail("a", einval, calls={1})
    policy = make_policy(world, [A, B], unavailable_ttl=3600)
    ctx = context()
    assert labels(policy, ctx, 3) == ["b", "b", "b"]
    world.wall += 3600
    assert labels(policy, ctx, 4) == ["b", "a", "a", "a"]  # noticed at the next record
    assert policy.explain(ctx).unavailable == {}
    assert entry_of(policy, ctx).arms["a"].failures == 1


# -- forcing ----------------------------------------------------------------------------------


def test_force_uses_that_arm_only_and_still_learns():
    world = World({"a": 10 * GB, "b": 5 * GB, "d": 1 * GB})
    policy = make_policy(world, [A, B])
    ctx = context()
    assert call(policy, ctx, force=D) == D
    assert world.calls == {"d": 1}
    assert entry_of(policy, ctx).arms["d"].estimate == pytest.approx(1 * GB)
    explanation = policy.explain(ctx, force=D)
    assert (explanation.phase, explanation.chosen, explanation.reason) == ("forced", "d", "forced")
    assert {arm.label: arm.state for arm in explanation.arms}["d"] == "not a candidate"
    assert call(policy, ctx) == A  # forcing did not disturb the exploration


def test_a_forced_arm_that_fails_raises_without_fallback_or_mark():
    world = World({"a": 10 * GB, "b": 5 * GB})
    world.fail("b", einval)
    policy = make_policy(world, [A, B])
    ctx = context()
    with pytest.raises(OSError, match="Invalid argument"):
        call(policy, ctx, force=B)
    assert world.calls == {"b": 1}
    assert policy.explain(ctx).unavailable == {}


# -- persistence ------------------------------------------------------------------------------


def test_a_reloaded_table_is_exploited_at_once(tmp_path):
    speeds = {"a": 2 * GB, "b": 9 * GB, "c": 5 * GB}
    world = World(speeds)
    policy = make_policy(world, [A, B, C])
    ctx = context()
    labels(policy, ctx, 6)
    path = tmp_path / "dispatch.json"
    policy.table.save(path)

    fresh = World(speeds)
    reloaded = make_policy(fresh, [A, B, C], Table.load(path, clock=fresh.wall_clock))
    assert labels(reloaded, ctx, 10) == ["b"] * 10
    assert fresh.calls == {"b": 10}
    # What was learned also seeds the neighbours after the reload.
    assert call(reloaded, context(22)) == B


# -- threads ----------------------------------------------------------------------------------


def test_threads_hammering_run_keep_the_table_consistent(tmp_path):
    speeds = {"a": 2 * GB, "b": 9 * GB, "c": 5 * GB, "flaky": 4 * GB}
    world = World(speeds)
    world.fail("flaky", einval, calls={1, 2})
    arms = [A, Arm("flaky"), C, B]
    policy = make_policy(world, arms)
    contexts = [context(20), context(24, direction="write"), context(16, load=2)]
    threads, per_thread = 8, 150
    path = tmp_path / "dispatch.json"
    errors: list[BaseException] = []
    done = threading.Event()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(per_thread):
                call(policy, rng.choice(contexts), MiB)
        except BaseException as error:  # noqa: BLE001 - reported by the assert below
            errors.append(error)

    def saver() -> None:
        while not done.is_set():
            policy.table.save(path)

    pool = [threading.Thread(target=worker, args=(seed,)) for seed in range(threads)]
    saving = threading.Thread(target=saver)
    saving.start()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    done.set()
    saving.join()
    assert errors == []

    total = threads * per_thread
    with policy.table.lock:
        entries = [policy.table.get(ctx.key()) for ctx in contexts]
        assert sum(stats.count for entry in entries for stats in entry.arms.values()) == total
        assert sum(stats.failures for entry in entries for stats in entry.arms.values()) == 2
        assert all((entry.phase, entry.chosen) == (EXPLOITING, "b") for entry in entries)
    assert sum(world.calls.values()) == total + 2
    assert policy._in_flight == {}
    policy.table.save(path)
    assert Table.load(path).to_json() == policy.table.to_json()


def test_logging_says_when_a_tool_is_dropped_and_when_it_reexplores(caplog):
    world = World({"a": 10 * GB, "b": 6 * GB})
    world.fail("b", einval, calls={1})
    policy = make_policy(world, [A, B], explore_samples=1)
    ctx = context()
    with caplog.at_level(logging.INFO, logger="arrayio.dispatch"):
        labels(policy, ctx, 3)
        world.speeds["a"] = 1 * GB
        labels(policy, ctx, 3)
    messages = [record.getMessage() for record in caplog.records]
    assert any("b failed (OSError" in message for message in messages)
    assert any("re-exploring" in message for message in messages)


# -- tunables ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tunables",
    [
        {"explore_samples": 0},
        {"explore_samples": 9},
        {"prune_ratio": 1.0},
        {"prune_ratio": -0.1},
        {"drift_ratio": 0},
        {"drift_ratio": 1},
        {"drift_patience": 0},
        {"min_bytes_to_learn": -1},
        {"unavailable_ttl": 0},
        {"contend_samples": 1},
        {"contend_samples": 9},
        {"contend_ratio": 0},
        {"contend_ratio": 1.5},
    ],
)
def test_tunables_out_of_range_are_refused(tunables):
    with pytest.raises(ValueError):
        Policy(lambda _context: [A], **tunables)


def test_candidates_must_be_arms():
    policy = Policy(lambda _context: ["posix"])
    with pytest.raises(TypeError, match="Arm instances"):
        policy.choose(context())


def test_the_first_call_of_a_new_tool_is_not_a_sample() -> None:
    # Setting a tool up (threads, pinned buffers) can cost more than its first transfer: that
    # call must not be what exploration judges the arm by.
    fast, slow = Arm.of("fast"), Arm.of("slow")
    world = World({fast.label: 2 * GB, slow.label: 1.5 * GB})  # close: no pruning
    policy = make_policy(world, [slow, fast], skip_first_call=True)
    ctx = context()
    call(policy, ctx)  # slow's first call: run, but not recorded
    assert all(report.samples == 0 for report in policy.explain(ctx).arms)
    for _ in range(5):
        call(policy, ctx)
    explanation = policy.explain(ctx)
    assert explanation.phase == "exploiting" and explanation.chosen == fast.label
    # Two samples of each arm cost three calls each: one more than without setup calls.
    assert world.calls == {fast.label: 3, slow.label: 3}
    assert sum(report.samples for report in explanation.arms) == 4


def test_sampling_times_one_exploiting_call_in_n_and_still_falls_back() -> None:
    fast, slow = Arm.of("fast"), Arm.of("slow")
    world = World({fast.label: 2 * GB, slow.label: 1.5 * GB})
    policy = make_policy(world, [slow, fast], sample_every=4)
    ctx = context()
    while policy.explain(ctx).phase != "exploiting":
        call(policy, ctx)
    counted = {r.label: r.count for r in policy.explain(ctx).arms}
    for _ in range(8):
        assert call(policy, ctx) == fast
    after = {r.label: r.count for r in policy.explain(ctx).arms}
    assert after[fast.label] - counted[fast.label] == 2  # 2 of the 8 calls were timed
    # A tool failure on an untimed call takes the full path: marked, and the call falls back.
    world.fail(fast.label, lambda: ToolUnavailableError("gone"))
    assert call(policy, ctx) == slow
    assert fast.label in policy.explain(ctx).unavailable


def test_a_context_waiting_for_a_rivals_set_up_times_one_call_in_n() -> None:
    # Until the rival's set-up is earned (the context's calls taking setup_after seconds),
    # every call of an exploring context goes whole to its best arm so far: sampled as an
    # exploiting context's calls are, not timed each.
    world = World({"a": 1 * GB, "b": 1 * GB})
    policy = make_policy(world, [A, B], skip_first_call=True, setup_after=1e9, sample_every=4)
    ctx = context()

    def as_the_dispatcher_calls() -> Arm:
        split = policy.split(ctx)
        if split is None:
            return call(policy, ctx)
        return call(policy, ctx, prefer=split.incumbent, waiting=not split.share)

    while {r.label: r.samples for r in policy.explain(ctx).arms}.get("a", 0) < PREPARE_AFTER:
        assert as_the_dispatcher_calls() == A
    split = policy.split(ctx)
    assert split is not None and split.incumbent == A and split.share == 0
    counted = {r.label: r.count for r in policy.explain(ctx).arms}["a"]
    for _ in range(8):
        assert call(policy, ctx, prefer=split.incumbent, waiting=True) == A
    assert {r.label: r.count for r in policy.explain(ctx).arms}["a"] - counted == 2
    assert world.calls["b"] == 0
    # The incumbent's part of a call shared with a rival is timed each time.
    for _ in range(4):
        assert call(policy, ctx, prefer=split.incumbent) == A
    assert {r.label: r.count for r in policy.explain(ctx).arms}["a"] - counted == 6
    # Asked by a caller that runs the tool itself: untimed calls come back with their tool;
    # the timed one is left for the full path, which counts it and times it.
    started = policy._started
    given = [policy.untimed_arm(ctx, split) for _ in range(3)]
    assert all(g is not None and g[0] == A for g in given)
    assert policy._started == started + 3  # calls that start: no idle gap for a set-up
    counted = {r.label: r.count for r in policy.explain(ctx).arms}["a"]
    for _ in range(3):
        assert policy.untimed_arm(ctx, split) is None
    assert call(policy, ctx, prefer=A, waiting=True) == A
    assert {r.label: r.count for r in policy.explain(ctx).arms}["a"] == counted + 1


def test_the_policy_module_still_offers_every_name_it_had() -> None:
    # Its parts moved to modules of their own (arm, explain, failures...); importers of
    # arrayio.dispatch.policy keep working.
    import arrayio.dispatch
    from arrayio.dispatch import policy

    assert set(policy.__all__) >= {"Arm", "ArmReport", "Explanation", "Policy", "is_tool_failure"}
    for name in policy.__all__:
        assert getattr(policy, name) is getattr(arrayio.dispatch, name)


# -- learning within calls --------------------------------------------------------------------


def learn_a(policy: Policy, ctx: Context, samples: int = 2) -> None:
    """Give arm A (the prior) its samples: whole calls, before anything can be split."""
    for _ in range(samples):
        assert policy.split(ctx) is None  # nothing measured: the prior takes the call
        assert call(policy, ctx) == A


def test_nothing_is_split_before_the_prior_is_measured_or_once_exploiting():
    world = World({"a": 2 * GB, "b": 1 * GB})
    policy = make_policy(world, [A, B])
    ctx = context()
    assert policy.split(ctx) is None
    call(policy, ctx)  # A, measured
    split = policy.split(ctx)
    assert split is not None and (split.incumbent, split.rival) == (A, B)
    for _ in range(2):
        call(policy, ctx, force=B)
    call(policy, ctx, force=A)
    assert entry_of(policy, ctx).phase == EXPLOITING
    assert policy.split(ctx) is None
    with policy.whole_calls():
        assert policy.split(ctx) is None and not policy.within_calls
    assert policy.within_calls


@pytest.mark.parametrize(
    ("rival_speed", "expected"),
    [(None, 1 / 64), (0.8, 0.4), (0.6, 0.15), (1.0, 0.5), (0.51, 0.104)],
)
def test_a_rivals_share_bounds_the_time_it_loses(rival_speed, expected):
    world = World({"a": 1 * GB, "b": (rival_speed or 1) * GB})
    policy = make_policy(world, [A, B], explore_samples=3, contend_samples=3)
    ctx = context()
    call(policy, ctx)
    if rival_speed is not None:
        call(policy, ctx, force=B)
    split = policy.split(ctx)
    assert split is not None and split.rival == B
    assert split.share == pytest.approx(expected, rel=0.01)
    # What it loses, as a fraction of the call: share * (1 / ratio - 1) <= regret.
    if rival_speed is not None:
        assert split.share * (1 / rival_speed - 1) <= policy.regret + 1e-9


def test_a_rival_is_set_up_in_the_background_before_its_first_share(exploring):
    # Its threads, pinned buffers and imports would cost its first share ten times the
    # transfer: until they are ready, the incumbent takes whole calls.
    prepared = threading.Event()
    release = threading.Event()

    class Slow(FakeTool):
        def prepare(self) -> None:
            release.wait(10)
            prepared.set()

    speeds = {"a": 1 * GB, "b": 1 * GB}
    sizes = [8 * MiB] * 64
    world = exploring(speeds, [A, B], sum(sizes))
    policy = world.dispatcher.policy = make_policy(world.world, [A, B], skip_first_call=True)
    policy._make = lambda arm: Slow(world.world, arm)
    # Each call takes 0.54 s: set up only once the context's calls took 2 s, after the
    # incumbent's two samples (its first call, which set its tool up, is not one).
    seconds = []
    while not policy._preparing and len(seconds) < 10:
        seconds.append(world.read_many(sizes))
    assert len(seconds) == 5 and sum(seconds[:4]) >= 2.0 > sum(seconds[:3])
    assert world.world.calls["b"] == 0
    [key] = [key for key, _ in policy.table.items()]
    split = policy.split(_context_of(world.dispatcher))
    assert split is not None and split.rival == B and split.share == 0
    release.set()
    assert prepared.wait(10)
    for _ in range(50):  # the background thread marks it ready right after
        split = policy.split(_context_of(world.dispatcher))
        if split is not None and split.share:
            break
        time.sleep(0.01)
    assert split is not None and split.share == policy.first_share
    world.read_many(sizes)
    assert world.world.calls["b"] >= 1  # its first share, recorded: the tool was set up
    assert policy.table.get(key).arms["b"].samples == 1


def test_a_rival_is_not_set_up_while_another_arm_of_its_tool_is():
    # One set-up of a tool at a time, a rival's too: the other arm's (beside a cold read,
    # say) would otherwise share its import and its pinning with the rival's.
    world = World({"a": 1 * GB, "b": 1 * GB})
    policy = make_policy(world, [A, B], skip_first_call=True, setup_after=0.0)
    ctx = context()
    for _ in range(PREPARE_AFTER + 1):
        call(policy, ctx, force=A)
    policy.account(ctx, 10.0)  # the context's calls have earned the rival its set-up
    entry = entry_of(policy, ctx)
    other = Arm.of("b", task=16)
    policy._preparing.add(other)
    assert policy._set_up(ctx.key(), entry, A, B) is False
    assert policy._preparing == {other} and policy.set_ups() == []  # none began
    policy._preparing.clear()  # that set-up ended: the rival's turn
    policy._set_up(ctx.key(), entry, A, B)
    _wait_ready(policy, B)


def _context_of(dispatcher) -> Context:
    return dispatcher.last[0]


def test_the_policy_refuses_out_of_range_shares():
    world = World({"a": 1 * GB})
    with pytest.raises(ValueError, match="regret"):
        make_policy(world, [A], regret=0)
    with pytest.raises(ValueError, match="first_share"):
        make_policy(world, [A], first_share=0.75)


def test_an_undivided_call_goes_to_the_rival_only_within_the_regret_budget():
    world = World({"a": 1 * GB, "b": 1 * GB})
    policy = make_policy(world, [A, B])
    ctx = context()
    call(policy, ctx)  # a: 1 GB/s, so a call of 1 GB takes 1 s, a rival's at most 2 s
    split = policy.split(ctx)
    policy.account(ctx, 1.0)
    assert policy.undivided(ctx, split, int(GB)) == A  # 2 s of 3 s would be a rival's
    for _ in range(20):
        policy.account(ctx, 1.0)
    assert policy.undivided(ctx, split, int(GB)) == B  # 2 s of 23 s: within 10 %
    policy.account(ctx, 2.0, explored=2.0)
    assert policy.undivided(ctx, split, int(GB)) == A


# -- the dispatcher's calls, divided --------------------------------------------------------


class ExploringDispatcher:
    """A dispatcher on fake tools and the world's clock, over a real scratch file."""

    def __init__(self, world: World, arms: list[Arm], tmp_path, nbytes: int) -> None:
        from arrayio.dispatch.dispatcher import Dispatcher

        self.world = world
        self.dispatcher = Dispatcher(None, clock=world.clock)
        self.dispatcher.policy = make_policy(world, arms)
        self.path = tmp_path / "data.bin"
        self.path.write_bytes(b"\0" * nbytes)
        self.fd = os.open(self.path, os.O_RDONLY)

    def read_many(self, sizes: list[int]) -> float:
        """Seconds of one batch read of arrays of ``sizes`` (on the world's clock)."""
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        requests = [(o, np.empty(s, np.uint8)) for o, s in zip(offsets, sizes, strict=True)]
        start = self.world.clock()
        self.dispatcher.read_many(self.fd, requests)
        return self.world.clock() - start

    def read_files(self, sizes: list[int]) -> float:
        """Seconds of one read of files of ``sizes`` as one batch (the fake tools move no
        bytes: every request names the scratch file)."""
        requests = [(self.fd, 0, np.empty(s, np.uint8)) for s in sizes]
        start = self.world.clock()
        self.dispatcher.read_files(requests)
        return self.world.clock() - start

    def read_many_files(self, sizes: list[int]) -> float:
        """Seconds of one batch read of a checkpoint's files of arrays of ``sizes`` (every
        request names the scratch file, as for :meth:`read_files`)."""
        requests = [(self.fd, 0, np.empty(s, np.uint8)) for s in sizes]
        start = self.world.clock()
        self.dispatcher.read_many_files(requests, paths=[str(self.path)] * len(sizes))
        return self.world.clock() - start

    def read(self, nbytes: int, with_checksum: bool = False) -> tuple[float, int | None]:
        start = self.world.clock()
        crc = self.dispatcher.read(
            self.fd, np.empty(nbytes, np.uint8), 0, with_checksum=with_checksum
        )
        return self.world.clock() - start, crc

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def exploring(tmp_path):
    made: list[ExploringDispatcher] = []

    def make(speeds: dict[str, float], arms: list[Arm], nbytes: int) -> ExploringDispatcher:
        made.append(ExploringDispatcher(World(speeds), arms, tmp_path, nbytes))
        return made[-1]

    yield make
    for each in made:
        each.close()


def test_no_call_of_a_batch_loses_more_than_the_regret_to_exploring(exploring):
    # The prior is the fastest; the others are 1.25x to 8x slower. Every call costs at most
    # the regret (10 %) more than the prior alone would, or for a rival's first sample,
    # before anything is known of it, its first share times its slowdown (7/64 here).
    speeds = {"a": 8 * GB, "b": 6.4 * GB, "c": 4 * GB, "d": 1 * GB}
    sizes = [16 * MiB] * 64
    world = exploring(speeds, [A, B, C, Arm("d")], sum(sizes))
    policy = world.dispatcher.policy
    prior_alone = sum(sizes) / speeds["a"]
    ratios = [world.read_many(sizes) / prior_alone for _ in range(40)]
    first_sample_loss = policy.first_share * (speeds["a"] / speeds["d"] - 1)
    assert max(ratios) <= 1 + max(policy.regret, first_sample_loss) + 1e-9, ratios
    assert sorted(ratios)[-2] <= 1 + policy.regret + 1e-9, ratios  # that one call alone
    [key] = [key for key, _ in policy.table.items()]
    entry = policy.table.get(key)
    assert entry.phase == EXPLOITING and entry.chosen == "a"
    assert all(entry.arms[label].samples >= 1 for label in "bcd")  # every rival measured
    assert ratios[-1] == pytest.approx(1.0)  # settled: no more exploring


@pytest.mark.parametrize(
    ("read", "sizes"),
    [
        ("read_files", [MiB] * 256),
        ("read_many_files", [16 * MiB] * 64),
        ("read_many_files", [16 * MiB] * 15 + [256 * MiB]),
    ],
    ids=["zarr-chunk-files", "checkpoint-shards", "a-large-last-tensor"],
)
def test_no_read_of_many_files_loses_more_than_the_regret_to_exploring(exploring, read, sizes):
    # As for a batch of one file, with whole requests for the rival's share: a Zarr array's
    # chunk files, or a checkpoint's shards, read again and again, pay a bounded part of
    # each read to exploring.
    speeds = {"a": 8 * GB, "b": 6.4 * GB, "c": 4 * GB, "d": 1 * GB}
    world = exploring(speeds, [A, B, C, Arm("d")], sizes[0])
    policy = world.dispatcher.policy
    prior_alone = sum(sizes) / speeds["a"]
    ratios = [getattr(world, read)(sizes) / prior_alone for _ in range(40)]
    # Whole requests, the smallest: one at least, never more than the share or one
    # average request's bytes.
    first = max(policy.first_share, 1 / len(sizes))
    first_sample_loss = first * (speeds["a"] / speeds["d"] - 1)
    assert max(ratios) <= 1 + max(policy.regret, first_sample_loss) + 0.01, ratios
    [key] = [key for key, _ in policy.table.items()]
    entry = policy.table.get(key)
    assert entry.phase == EXPLOITING and entry.chosen == "a"
    assert all(entry.arms[label].samples >= 1 for label in "bcd")
    assert ratios[-1] == pytest.approx(1.0)


def test_a_read_of_one_file_is_not_divided():
    from arrayio.dispatch.dispatcher import _files_share

    one = [(0, 0, np.empty(MiB, np.uint8))]
    assert _files_share(one, 0.5) == []
    many = [(0, 0, np.empty(n, np.uint8)) for n in (MiB, MiB, 2 * MiB, MiB)]
    assert _files_share(many, 0.0) == []
    assert _files_share(many, 0.2) == [3]  # the last of the smallest: a fifth of the bytes
    assert _files_share(many, 0.01) == [3]  # one at least
    assert _files_share(many, 0.99) == [0, 1, 3]  # never all: the largest stays
    # A large last request (a checkpoint's output head) is not the rival's share.
    head = [(0, 0, np.empty(n, np.uint8)) for n in (MiB, MiB, MiB, 8 * MiB)]
    assert _files_share(head, 0.2) == [1, 2]
    assert _files_share(head, 0.01) == [2]


def test_a_faster_rival_found_within_calls_takes_over(exploring):
    speeds = {"a": 2 * GB, "b": 8 * GB}
    sizes = [8 * MiB] * 64
    world = exploring(speeds, [A, B], sum(sizes))
    for _ in range(12):
        world.read_many(sizes)
    [key] = [key for key, _ in world.dispatcher.policy.table.items()]
    assert world.dispatcher.policy.table.get(key).chosen == "b"
    assert world.read_many(sizes) == pytest.approx(sum(sizes) / speeds["b"])


def test_a_rival_that_fails_leaves_its_part_to_the_incumbent(exploring):
    speeds = {"a": 2 * GB, "b": 8 * GB}
    sizes = [8 * MiB] * 64
    world = exploring(speeds, [A, B], sum(sizes))
    world.world.fail("b", lambda: ToolUnavailableError("b cannot run here"))
    for _ in range(4):
        world.read_many(sizes)
    moved = world.world.calls
    assert moved["a"] >= 4 * 64 - 1  # every request read once by a (b's part redone by a)
    [key] = [key for key, _ in world.dispatcher.policy.table.items()]
    assert world.dispatcher.policy.table.get(key).arms["b"].unavailable


def test_a_transfer_alone_is_cut_in_two_and_its_checksum_is_whole(tmp_path):
    # Real tools and a real file: the two parts' CRCs combine into the whole one's.
    from arrayio.integrity._checksum import checksum

    data = np.random.default_rng(0).integers(0, 256, 64 * MiB, dtype=np.uint8)
    path = tmp_path / "d.bin"
    path.write_bytes(data.tobytes())
    arms = [Arm.of("posix", threads=2, task_size=4 * MiB), Arm.of("naive")]
    dispatcher, parts = recording_dispatcher(arms)
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(12):  # the rival is set up in the background after a few calls
            out = np.empty(data.nbytes, np.uint8)
            crc = dispatcher.read(fd, out, 0, with_checksum=True)
            assert crc == checksum(data) and out.tobytes() == data.tobytes()
            if any(0 < part < data.nbytes for part in parts):
                break
            time.sleep(0.05)
    finally:
        os.close(fd)
        dispatcher.close()
    assert any(0 < part < data.nbytes for part in parts), parts  # a call was cut


@pytest.mark.parametrize("memory", ["host", "device"])
def test_a_batch_divided_within_a_request_returns_each_requests_whole_crc(tmp_path, memory):
    from arrayio.integrity._checksum import checksum
    from arrayio.tools.naive import NaiveTool

    sizes = [24 * MiB, 40 * MiB]
    data = np.random.default_rng(1).integers(0, 256, sum(sizes), dtype=np.uint8)
    path = tmp_path / "d.bin"
    path.write_bytes(data.tobytes())
    if memory == "host":
        arms = [Arm.of("posix", threads=2, task_size=4 * MiB), Arm.of("naive")]
        dispatcher, pieces = recording_dispatcher(arms)

        def buffer(size: int):
            return np.empty(size, np.uint8)

        def content(out) -> bytes:
            return out.tobytes()
    else:  # a cut request's pieces are views of one device buffer: both land in it
        arms = [Arm("naive"), Arm("naive-again")]  # two arms, one tool that serves devices
        dispatcher, pieces = recording_dispatcher(arms, make=lambda _arm: NaiveTool())

        def buffer(size: int):
            return PartedDevice(np.zeros(size, np.uint8))

        def content(out) -> bytes:
            return out.data.tobytes()

    done: list[int] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(12):  # the rival is set up in the background after a few calls
            outs = [buffer(size) for size in sizes]
            requests = [(0, outs[0]), (sizes[0], outs[1])]
            crcs = dispatcher.read_many(fd, requests, with_checksum=True, done=done.append)
            assert crcs == [checksum(data[: sizes[0]]), checksum(data[sizes[0] :])]
            assert b"".join(content(o) for o in outs) == data.tobytes()
            if any(part % MiB == 0 and part < sizes[1] for part in pieces):
                break
            time.sleep(0.05)
    finally:
        os.close(fd)
        dispatcher.close()
    assert any(part % MiB == 0 and part < sizes[1] for part in pieces), pieces  # cut
    calls = len(done) // 2
    assert sorted(done) == [0] * calls + [1] * calls  # each request reported once per call


class PartedDevice:
    """Host bytes posing as device memory that can be viewed in parts, as torch's and CuPy's
    buffers can: what a cut request's two pieces write must land in the one array."""

    device_index = 0

    def __init__(self, data: np.ndarray) -> None:
        self.data, self.nbytes = data, data.nbytes

    def copy_to_host(self, offset: int, dst: np.ndarray) -> None:
        dst[...] = self.data[offset : offset + dst.nbytes]

    def copy_from_host(self, offset: int, src: np.ndarray) -> None:
        self.data[offset : offset + src.nbytes] = src

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def part(self, start: int, stop: int) -> PartedDevice:
        return PartedDevice(self.data[start:stop])


def test_device_writes_divided_between_two_arms_write_every_byte_once(tmp_path):
    from arrayio.integrity._checksum import checksum
    from arrayio.tools.naive import NaiveTool

    sizes = [24 * MiB, 40 * MiB]
    rng = np.random.default_rng(3)
    arms = [Arm("naive"), Arm("naive-again")]
    dispatcher, pieces = recording_dispatcher(arms, make=lambda _arm: NaiveTool())
    try:
        for i in range(12):
            data = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
            path = tmp_path / f"w{i}.bin"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                ins = [PartedDevice(data[: sizes[0]].copy()), PartedDevice(data[sizes[0] :].copy())]
                crcs = dispatcher.write_many(
                    fd, [(0, ins[0]), (sizes[0], ins[1])], with_checksum=True
                )
            finally:
                os.close(fd)
            assert crcs == [checksum(data[: sizes[0]]), checksum(data[sizes[0] :])]
            assert path.read_bytes() == data.tobytes()
            if any(part % MiB == 0 and part < sizes[1] for part in pieces):
                break
            time.sleep(0.05)
    finally:
        dispatcher.close()
    assert any(part % MiB == 0 and part < sizes[1] for part in pieces), pieces  # cut


def recording_dispatcher(arms: list[Arm], **policy) -> tuple:
    """A dispatcher on real tools whose policy records the bytes of every run: a call cut
    in two shows as two runs smaller than the whole. Rivals are set up at once."""
    from arrayio.dispatch.dispatcher import Dispatcher

    dispatcher = Dispatcher(None)
    dispatcher.policy = Policy(lambda _context: arms, Table(), setup_after=0.0, **policy)
    parts: list[int] = []
    real_run = dispatcher.policy.run

    def run(ctx, nbytes, operation, **kwargs):
        parts.append(nbytes)
        return real_run(ctx, nbytes, operation, **kwargs)

    dispatcher.policy.run = run
    return dispatcher, parts


def test_explain_says_which_page_cache_rule_a_read_falls_under():
    world = World({"a": 1 * GB})
    policy = make_policy(world, [A])
    keep = Context("read", "cuda", 30, "vda", "cold", 1, keep=True)
    cold = Context("read", "cuda", 30, "vda", "cold", 1)
    warm = Context("read", "cuda", 30, "vda", "warm", 1)
    write = Context("write", "cuda", 30, "vda", "-", 1)
    assert "fits twice in the memory available" in policy.explain(keep).rule
    assert "no O_DIRECT arm" in policy.explain(keep).rule
    assert "O_DIRECT arms first" in policy.explain(cold).rule
    assert "in the page cache" in policy.explain(warm).rule
    assert policy.explain(write).rule is None
    assert policy.explain(keep).as_dict()["rule"] == policy.explain(keep).rule
    # A kept read's rule says it is read once more in the background, unless turned off.
    assert "second pass" in policy.explain(keep).rule
    with arrayio.config.set(second_pass=False):
        assert "second pass" not in policy.explain(keep).rule


def test_explain_says_a_rival_waits_to_be_set_up():
    world = World({"a": 1 * GB, "b": 1 * GB})
    policy = make_policy(world, [A, B], skip_first_call=True)
    ctx = context()
    labels(policy, ctx, 3)  # a's first call set it up; two samples
    assert "set up once the context's calls have taken 2 s" in policy.explain(ctx).reason
    assert not policy._preparing  # explaining started nothing


# -- stand-ins for tools that cost seconds to set up ------------------------------------------


def _standing_in(world: World, arms: list[Arm], setups: dict[str, float], prepared, **tunables):
    """A policy whose arms' tools declare ``setups`` seconds of set-up; a tool's prepare()
    waits for ``prepared`` (an Event) before it returns. The calls come back to back: no
    gap between them counts as the program's own work unless ``idle_wait`` is given."""

    class Prepared(FakeTool):
        def prepare(self) -> None:
            prepared.wait(10)

    tunables.setdefault("idle_wait", 3600.0)
    policy = make_policy(
        world, arms, setup_seconds=lambda arm: setups.get(arm.name, 0.0), **tunables
    )
    policy._make = lambda arm: Prepared(world, arm)
    return policy


def _wait_ready(policy: Policy, arm: Arm) -> None:
    for _ in range(500):  # the background thread marks it ready right after prepare()
        if arm in policy._ready:
            return
        time.sleep(0.01)
    raise AssertionError(f"{arm} was never set up")


def test_a_tool_that_costs_more_to_set_up_than_a_short_call_has_a_stand_in():
    # The prior (a) costs 0.1 s to set up; a 64 MiB call at the first guess's 10 GB/s takes
    # 7 ms. The first candidate with nothing to set up (c; b costs too) runs the first calls;
    # a is set up in the background once c's calls have taken stand_in_for times a's set-up
    # (5 ms here: after the first), and runs the calls after that.
    prepared = threading.Event()
    world = World({"a": 30 * GB, "b": 30 * GB, "c": 10 * GB})
    policy = _standing_in(
        world, [A, B, C], {"a": 0.1, "b": 0.1}, prepared, skip_first_call=True, stand_in_for=0.05
    )
    ctx = context(26)
    assert call(policy, ctx, 64 * MiB) == C
    assert not policy._preparing  # a process that loads once never sets a up
    assert policy.setting_up() == []
    assert call(policy, ctx, 64 * MiB) == C
    assert policy._preparing == {A}
    assert policy.setting_up() == [A]  # what a caller may ask (the first-calls benchmark)
    assert call(policy, ctx, 64 * MiB) == C  # still setting up
    prepared.set()
    _wait_ready(policy, A)
    assert policy.setting_up() == []
    assert call(policy, ctx, 64 * MiB) == A
    assert world.calls["a"] == 1 and world.calls["b"] == 0
    # a's first call, which pins its buffers, is no sample; nor are the stand-in's calls,
    # which must not make c the incumbent that a (measured on small shares) has to beat.
    assert "a" not in entry_of(policy, ctx).arms
    assert "c" not in entry_of(policy, ctx).arms
    call(policy, ctx, 64 * MiB)
    assert entry_of(policy, ctx).arms["a"].samples == 1


def test_a_call_long_enough_to_hide_the_set_up_runs_the_chosen_arm():
    # 0.1 s of set-up is within the regret (10%) of a call that takes more than 1 s at the
    # arm's measured rate: 16 GiB at 10 GB/s takes 1.7 s; 4 GiB takes 0.43 s.
    prepared = threading.Event()
    prepared.set()
    world = World({"a": 10 * GB, "c": 5 * GB})
    policy = _standing_in(world, [A, C], {"a": 0.1}, prepared)
    assert call(policy, context(34), 16 << 30) == A
    world2 = World({"a": 10 * GB, "c": 5 * GB})
    policy2 = _standing_in(world2, [A, C], {"a": 0.1}, prepared)
    assert call(policy2, context(32), 4 << 30) == C


def test_a_learned_arm_is_judged_at_its_measured_rate():
    # Learned at 1 GB/s (a cold disk), a 1.5 GiB call takes 1.6 s and hides the set-up:
    # the arm itself runs, in a new process (a new policy on the same table).
    prepared = threading.Event()
    prepared.set()
    world = World({"a": 1 * GB, "c": 0.5 * GB})
    first = _standing_in(world, [A, C], {}, prepared)  # set-up costs nothing: learn a
    ctx = context(31)
    labels(first, ctx, 6, 1536 * MiB)
    assert entry_of(first, ctx).chosen == "a"
    second = _standing_in(world, [A, C], {"a": 0.1}, prepared, table=first.table)
    assert call(second, ctx, 1536 * MiB) == A
    third = _standing_in(world, [A, C], {"a": 0.5}, prepared, table=first.table)
    assert call(third, ctx, 1536 * MiB) == C  # 0.5 s would not hide


def test_the_stand_ins_calls_of_any_context_set_the_arm_up_once_they_take_its_set_up():
    # A cold load, then warm ones (two contexts), each 64 MiB at c's 10 GB/s (6.7 ms): their
    # time adds up across contexts, and a is set up after the first call that finds it past
    # stand_in_for times a's set-up (10 ms): the third.
    prepared = threading.Event()
    world = World({"a": 30 * GB, "c": 10 * GB})
    policy = _standing_in(world, [A, C], {"a": 0.1}, prepared, stand_in_for=0.1)
    assert call(policy, context(26, cache="cold"), 64 * MiB) == C
    assert call(policy, context(26), 64 * MiB) == C
    assert not policy._preparing  # 7 ms when it began
    assert call(policy, context(26), 64 * MiB) == C
    assert policy._preparing == {A}
    prepared.set()
    _wait_ready(policy, A)
    assert call(policy, context(26, cache="cold"), 64 * MiB) == A


def test_back_to_back_loads_set_the_arm_up_once_the_stand_in_has_cost_its_set_up():
    # Warm loads of 1.5 GiB at c's 30 GB/s take 54 ms each; a's set-up costs 0.2 s. The
    # ski-rental rule: a script that loads four times never pays for the set-up; one that
    # goes on loading sets a up after the first call to find the stand-in's calls past
    # 0.2 s (the fifth), and the call after it runs on a.
    prepared = threading.Event()
    prepared.set()
    world = World({"a": 40 * GB, "c": 30 * GB})
    policy = _standing_in(world, [A, C], {"a": 0.2}, prepared)
    assert labels(policy, context(31), 4, 1536 * MiB) == ["c"] * 4
    assert not policy._preparing and A not in policy._tools
    assert labels(policy, context(31), 1, 1536 * MiB) == ["c"]
    _wait_ready(policy, A)
    assert labels(policy, context(31), 1, 1536 * MiB) == ["a"]


def test_stand_in_for_scales_the_rule_and_must_not_be_negative():
    prepared = threading.Event()
    prepared.set()
    world = World({"a": 40 * GB, "c": 30 * GB})
    policy = _standing_in(world, [A, C], {"a": 0.2}, prepared, stand_in_for=10.0)
    assert labels(policy, context(31), 12, 1536 * MiB) == ["c"] * 12
    assert not policy._preparing and A not in policy._tools
    for wrong in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="stand_in_for"):
            _standing_in(world, [A, C], {"a": 0.2}, prepared, stand_in_for=wrong)


def test_a_gap_after_a_stand_in_call_sets_the_arm_up_beside_the_programs_work():
    # One warm load, then the program computes (no call for longer than idle_wait): a is set
    # up in that gap, and the next load runs on it.
    prepared = threading.Event()
    prepared.set()
    world = World({"a": 30 * GB, "c": 10 * GB})
    policy = _standing_in(world, [A, C], {"a": 0.1}, prepared, idle_wait=0.01)
    assert call(policy, context(31), 1536 * MiB) == C
    _wait_ready(policy, A)
    assert call(policy, context(31), 1536 * MiB) == A


def test_a_call_within_idle_wait_keeps_the_set_up_for_later():
    # The next load starts before idle_wait has passed: the program is loading back to back,
    # and a set-up now would slow it; nothing is set up (the stand-in's two calls, 0.3 s,
    # are far from a's 1 s of set-up).
    prepared = threading.Event()
    prepared.set()
    world = World({"a": 30 * GB, "c": 10 * GB})
    policy = _standing_in(world, [A, C], {"a": 1.0}, prepared, idle_wait=0.3)
    assert call(policy, context(31), 1536 * MiB) == C
    assert call(policy, context(31), 1536 * MiB) == C
    time.sleep(0.6)  # the first call's watch has seen the second call start
    assert not policy._preparing and A not in policy._tools


def test_no_stand_in_where_every_candidate_costs_a_set_up():
    prepared = threading.Event()
    prepared.set()
    world = World({"a": 10 * GB, "b": 10 * GB})
    policy = _standing_in(world, [A, B], {"a": 0.1, "b": 0.1}, prepared)
    assert call(policy, context(20), MiB) == A


def test_an_arm_being_set_up_runs_no_untimed_call():
    # Learned: a wins. In a new process that samples one call in four, a is made by its
    # background set-up before it is ready; the calls meanwhile still go to the stand-in.
    prepared = threading.Event()
    prepared.set()
    world = World({"a": 30 * GB, "c": 10 * GB})
    learner = _standing_in(world, [A, C], {}, prepared)
    ctx = context(26)
    labels(learner, ctx, 6, 64 * MiB)
    assert entry_of(learner, ctx).chosen == "a"
    waiting = threading.Event()
    policy = _standing_in(
        world, [A, C], {"a": 0.1}, waiting, table=learner.table, sample_every=4, stand_in_for=0.05
    )
    assert labels(policy, ctx, 2, 64 * MiB) == ["c", "c"]
    for _ in range(500):  # the set-up thread makes a's tool, then waits in prepare()
        if A in policy._tools:
            break
        time.sleep(0.01)
    assert A in policy._tools and A in policy._preparing
    assert labels(policy, ctx, 4, 64 * MiB) == ["c"] * 4
    waiting.set()
    _wait_ready(policy, A)
    assert call(policy, ctx, 64 * MiB) == A


def test_a_long_read_from_the_disk_sets_the_arm_up_beside_its_stand_in():
    # A cold load of 1.5 GiB: at the disk's first guess (5 GB/s) it outlasts a's 0.1 s of
    # set-up, so a is set up during the stand-in's call, and the warm reloads that follow
    # run on a as soon as it is ready (not from the process's second stand-in call).
    prepared = threading.Event()
    world = World({"a": 30 * GB, "c": 10 * GB})
    policy = _standing_in(world, [A, C], {"a": 0.1}, prepared, setup_wait=0.0)
    assert call(policy, context(31, cache="cold"), 1536 * MiB) == C
    assert policy._preparing == {A}
    assert call(policy, context(31), 1536 * MiB) == C  # still being set up (not waited for)
    prepared.set()
    _wait_ready(policy, A)
    assert call(policy, context(31), 1536 * MiB) == A


class _CountedEvent(threading.Event):
    """An event that counts the calls waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self, timeout=None):
        self.waits += 1
        return super().wait(timeout)


def _preparing_beside_a_cold_read(prepared, **tunables) -> tuple[World, Policy]:
    """A policy whose arm a (0.1 s to set up) is being set up beside a cold read that its
    stand-in c ran; a's set-up ends when ``prepared`` is set."""
    world = World({"a": 30 * GB, "c": 10 * GB})
    policy = _standing_in(world, [A, C], {"a": 0.1}, prepared, **tunables)
    assert call(policy, context(31, cache="cold"), 1536 * MiB) == C
    assert policy._preparing == {A}
    return world, policy


def test_a_page_cache_call_waits_for_the_set_up_in_progress_and_runs_on_the_arm():
    # Right after a cold start, KvikIO's set-up (begun beside the cold read) may still be
    # running as the reload begins: a stand-in beside it would share the interpreter's lock
    # and the CUDA driver with it, so the reload waits for it and runs on KvikIO.
    prepared = threading.Event()
    world, policy = _preparing_beside_a_cold_read(prepared)
    threading.Timer(0.1, prepared.set).start()
    start = time.perf_counter()
    assert call(policy, context(31), 1536 * MiB) == A
    assert time.perf_counter() - start >= 0.09  # it waited for the set-up to end
    assert world.calls["c"] == 1 and world.calls["a"] == 1


def test_a_set_up_beside_a_cold_read_asks_for_its_files_before_the_reads_start():
    # With every cache cold, KvikIO's import faults its libraries in from a disk that the
    # cold read's requests fill: its files are asked for on the caller's thread first, while
    # the disk's queue is empty, then the set-up starts, then the stand-in reads.
    order: list[tuple[str, int]] = []
    prepared = threading.Event()

    class Recorded(FakeTool):
        def prepare(self) -> None:
            order.append(("set-up", threading.get_ident()))
            prepared.wait(10)

    world = World({"a": 30 * GB, "c": 10 * GB})
    policy = _standing_in(
        world,
        [A, C],
        {"a": 0.1},
        prepared,
        read_ahead=lambda arm: order.append(
            (f"ask for {arm.label}'s files", threading.get_ident())
        ),
    )
    policy._make = lambda arm: Recorded(world, arm)

    def cold_read(tool):
        for _ in range(500):  # (the set-up's thread records itself as it starts)
            if len(order) > 1:
                break
            time.sleep(0.01)
        order.append((f"{tool.label} reads", threading.get_ident()))
        return tool.transfer(1536 * MiB)

    policy.run(context(31, cache="cold"), 1536 * MiB, cold_read)
    me = threading.get_ident()
    assert [what for what, _ in order] == ["ask for a's files", "set-up", "c reads"]
    assert order[0][1] == me and order[1][1] != me and order[2][1] == me
    call(policy, context(31, cache="cold"), 1536 * MiB)  # asked once: a is being set up
    assert [what for what, _ in order].count("ask for a's files") == 1
    prepared.set()
    _wait_ready(policy, A)


@pytest.mark.parametrize("raised", [KeyboardInterrupt, OSError])
def test_a_read_ahead_that_raises_still_sets_the_arm_up(raised):
    # Interrupted (or failing) while asking for the files, the call leaves nothing claimed,
    # running or reserved behind it: the set-up still starts, and the calls go on.
    def read_ahead(arm):
        raise raised("no")

    set_up = threading.Event()
    set_up.set()
    world = World({"a": 30 * GB, "c": 10 * GB})
    policy = _standing_in(world, [A, C], {"a": 0.1}, set_up, read_ahead=read_ahead)
    cold = context(31, cache="cold")
    if raised is KeyboardInterrupt:  # (the caller's interrupt ends the call)
        with pytest.raises(KeyboardInterrupt):
            call(policy, cold, 1536 * MiB)
    else:  # (a failure to ask costs only time)
        assert call(policy, cold, 1536 * MiB) == C
    _wait_ready(policy, A)
    assert policy._running == 0 and policy._in_flight == {}
    assert call(policy, context(31), 1536 * MiB) == A


def test_a_cold_read_sets_up_the_arm_its_reload_will_choose():
    # The cold row's first candidate is KvikIO's large-task arm, the warm row's its 4 MiB
    # arm: the set-up beside the cold read is for the reloads, so it is the 4 MiB arm's
    # (KvikIO pins buffers of its arm's task size), the reload waits for it and runs on it,
    # and the large arm's first cold call runs on it without a stand-in (its tool is set up).
    prepared = threading.Event()
    large, small = Arm.of("a", task=16), Arm.of("a", task=4)
    world = World({large.label: 30 * GB, small.label: 30 * GB, "c": 10 * GB})
    policy = _standing_in(
        world, lambda ctx: [large, C] if ctx.cache == "cold" else [small, C], {"a": 0.1}, prepared
    )
    assert call(policy, context(31, cache="cold"), 1536 * MiB) == C
    assert policy._preparing == {small}
    threading.Timer(0.1, prepared.set).start()
    assert call(policy, context(31), 1536 * MiB) == small
    assert call(policy, context(31, cache="cold"), 1536 * MiB) == large
    assert policy._preparing == set()


def test_no_second_arm_of_a_tool_is_set_up_while_its_first_is():
    # After a cold read that set the reload's arm up beside it, the program computes: the
    # cold arm's idle watch does not set that arm up too while the first set-up runs (its
    # pinning would run beside the reload the first set-up is for). Once the tool is set
    # up, the cold arm's first call pays for its own.
    prepared = threading.Event()
    large, small = Arm.of("a", task=16), Arm.of("a", task=4)
    world = World({large.label: 30 * GB, small.label: 30 * GB, "c": 10 * GB})
    policy = _standing_in(
        world,
        lambda ctx: [large, C] if ctx.cache == "cold" else [small, C],
        {"a": 0.1},
        prepared,
        idle_wait=0.01,
    )
    assert call(policy, context(31, cache="cold"), 1536 * MiB) == C
    assert policy._idle_watches == {large}  # watching for a gap to set the cold arm up
    for _ in range(500):  # until the watch has looked (it found the gap)
        if not policy._idle_watches:
            break
        time.sleep(0.01)
    assert not policy._idle_watches
    assert policy._preparing == {small}
    prepared.set()
    _wait_ready(policy, small)
    assert call(policy, context(31), 1536 * MiB) == small
    assert call(policy, context(31, cache="cold"), 1536 * MiB) == large
    assert policy._preparing == set()


def test_a_cold_read_whose_reload_chooses_another_tool_sets_up_its_own_arm():
    prepared = threading.Event()
    prepared.set()
    world = World({"a": 30 * GB, "b": 30 * GB, "c": 10 * GB})
    policy = _standing_in(
        world, lambda ctx: [A, C] if ctx.cache == "cold" else [B, C], {"a": 0.1}, prepared
    )
    assert call(policy, context(31, cache="cold"), 1536 * MiB) == C
    _wait_ready(policy, A)
    assert call(policy, context(31, cache="cold"), 1536 * MiB) == A


def test_a_set_up_that_outlasts_the_wait_is_not_waited_for_again():
    prepared = threading.Event()
    world, policy = _preparing_beside_a_cold_read(prepared, setup_wait=0.05)
    assert call(policy, context(31), 1536 * MiB) == C  # waited 0.05 s, then stood in
    assert "a" in policy._waited_out
    spy = policy._set_up_done["a"] = _CountedEvent()
    assert call(policy, context(31), 1536 * MiB) == C
    assert spy.waits == 0
    prepared.set()
    _wait_ready(policy, A)
    assert call(policy, context(31), 1536 * MiB) == A


@pytest.mark.parametrize(
    ("ctx", "tunables", "why"),
    [
        (context(31, cache="cold"), {}, "a read from the disk: its waits hide the set-up"),
        (context(31, cache="unknown"), {}, "a read that may come from the disk"),
        (context(31, direction="write", cache="-"), {}, "a write"),
        (context(31), {"setup_wait": 0.0}, "setup_wait 0: calls never wait"),
    ],
)
def test_calls_that_do_not_wait_for_a_set_up(ctx, tunables, why):
    prepared = threading.Event()
    world, policy = _preparing_beside_a_cold_read(prepared, **tunables)
    spy = policy._set_up_done["a"] = _CountedEvent()
    assert call(policy, ctx, 1536 * MiB) == C, why
    assert spy.waits == 0, why
    prepared.set()
    _wait_ready(policy, A)
    assert spy.is_set()  # the set-up's end is told to whoever waits


def test_each_set_up_is_logged_with_its_steps():
    # What a set-up cost, and where (the first-calls benchmark records it per process).
    class Stepped(FakeTool):
        def prepare(self) -> None:
            with self.set_up_step("import"):
                time.sleep(0.02)
            with self.set_up_step("pinning"):
                pass

    class Broken(FakeTool):
        def prepare(self) -> None:
            raise OSError("no driver")

    world = World({"a": 30 * GB, "b": 30 * GB, "c": 10 * GB})
    policy = make_policy(
        world, [A, C], setup_seconds=lambda arm: 0.1 if arm.name in "ab" else 0.0, idle_wait=3600
    )
    policy._make = lambda arm: (Broken if arm.name == "b" else Stepped)(world, arm)
    before = time.perf_counter()
    assert call(policy, context(31, cache="cold"), 1536 * MiB) == C
    _wait_ready(policy, A)
    policy._candidates = lambda _context: [B, C]
    assert call(policy, context(30, cache="cold"), 1536 * MiB) == C
    _wait_ready(policy, B)
    first, second = policy.set_ups()
    assert first["arm"] == "a" and first["for"] == "stand-in" and first["began"] >= before
    assert set(first["steps"]) == {"import", "pinning"}
    assert first["steps"]["import"] >= 0.02 and first["seconds"] >= first["steps"]["import"]
    assert "error" not in first
    assert second["arm"] == "b" and second["error"] == "OSError: no driver"
    assert second["steps"] == {} and second["seconds"] is not None


def test_no_wait_for_a_rivals_set_up_of_an_arm_with_nothing_to_stand_in_for():
    # A rival's set-up (Policy._set_up) puts any arm in _preparing, the staged pipeline's
    # too, whose calls never had a stand-in: a call choosing it runs on it at once.
    prepared = threading.Event()
    world = World({"b": 10 * GB})
    policy = _standing_in(world, [B], {}, prepared, setup_wait=5.0)
    with policy._tools_lock:
        policy._preparing.add(B)
    policy._start_preparing(B, "another context")
    start = time.perf_counter()
    assert call(policy, context(31), 1536 * MiB) == B
    assert time.perf_counter() - start < 2.5  # (it did not wait the 5 s)
    prepared.set()
    _wait_ready(policy, B)


def test_an_interrupted_wait_gives_back_the_calls_reservation():
    prepared = threading.Event()
    world, policy = _preparing_beside_a_cold_read(prepared)

    class Interrupted(threading.Event):
        def wait(self, timeout=None):
            raise KeyboardInterrupt

    policy._set_up_done["a"] = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        call(policy, context(31), 1536 * MiB)
    assert policy._in_flight == {}
    prepared.set()
    _wait_ready(policy, A)


def test_no_wait_once_the_exit_has_begun(monkeypatch):
    # The exit starts no thread: a set-up claimed then never runs, and a call waiting for it
    # would only delay the exit.
    from arrayio.runtime import _background

    prepared = threading.Event()
    world = World({"a": 30 * GB, "c": 10 * GB})
    policy = _standing_in(world, [A, C], {"a": 0.1}, prepared, setup_wait=5.0)
    monkeypatch.setattr(_background, "_exit", threading.Event())
    _background._exit.set()
    assert call(policy, context(31, cache="cold"), 1536 * MiB) == C
    assert policy._preparing == {A}  # claimed, never started
    start = time.perf_counter()
    assert call(policy, context(31), 1536 * MiB) == C
    assert time.perf_counter() - start < 2.5  # (it did not wait the 5 s)


@pytest.mark.parametrize(
    ("cache", "nbytes", "why"),
    [
        ("warm", 1536 * MiB, "a page-cache read is short: the set-up would slow it"),
        ("cold", 256 * MiB, "51 ms at the disk's first guess: shorter than the set-up"),
    ],
)
def test_no_set_up_beside_a_short_or_page_cache_call(cache, nbytes, why):
    prepared = threading.Event()
    world = World({"a": 30 * GB, "c": 10 * GB})
    policy = _standing_in(world, [A, C], {"a": 0.1}, prepared)
    assert call(policy, context(31, cache=cache), nbytes) == C
    assert not policy._preparing, why


def test_an_arm_runs_itself_once_another_arm_of_its_tool_is_set_up():
    # The set-up is the tool's (KvikIO's import, its pinned pool): once one arm of it paid,
    # another arm of it (another task size) has nothing left to stand in for.
    prepared = threading.Event()
    prepared.set()
    a_large = Arm.of("a", task_size=16)
    world = World({"a": 30 * GB, a_large.label: 30 * GB, "c": 10 * GB})
    policy = _standing_in(
        world,
        lambda ctx: [a_large, C] if ctx.size_class == 31 else [A, C],
        {"a": 0.1},
        prepared,
    )
    assert call(policy, context(31, cache="cold"), 1536 * MiB) == C
    _wait_ready(policy, a_large)
    assert call(policy, context(26), 64 * MiB) == A


def test_an_exiting_process_waits_for_the_set_up_in_the_background():
    from arrayio.runtime import _background

    prepared = threading.Event()
    world = World({"a": 30 * GB, "c": 10 * GB})
    policy = _standing_in(world, [A, C], {"a": 0.1}, prepared)
    call(policy, context(31, cache="cold"), 1536 * MiB)
    threading.Timer(0.2, prepared.set).start()
    _background.join(timeout=10)
    assert A in policy._ready


def test_a_process_that_exits_during_a_set_up_waits_for_it_before_its_exit_handlers(tmp_path):
    # The set-up is still running when the script ends: the interpreter waits for it before
    # any atexit handler (those free what the set-up uses: pinned memory, streams), even a
    # handler registered after the policy's module was imported.
    done = tmp_path / "done"
    order = tmp_path / "order"
    script = f"""
import atexit, threading, time
from arrayio.dispatch import Arm, Policy, Table
from arrayio.tools import Tool

class Slow(Tool):
    def prepare(self):
        time.sleep(0.5)
        open({str(done)!r}, "w").write("set up")

    def pread(self, fd, buffer, file_offset, *, checksum=None):
        raise NotImplementedError

    def pwrite(self, fd, buffer, file_offset, *, checksum=None):
        raise NotImplementedError

def at_exit():
    import os
    first = "set up first" if os.path.exists({str(done)!r}) else "handler first"
    open({str(order)!r}, "w").write(first)

atexit.register(at_exit)
policy = Policy(lambda ctx: [], Table(), make=lambda arm: Slow())
arm = Arm("slow")
policy._preparing.add(arm)
policy._start_preparing(arm)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert done.exists(), result.stderr
    assert done.read_text() == "set up"
    assert order.read_text() == "set up first"


def test_a_settled_read_runs_its_tool_alone_and_one_call_in_n_in_full(exploring, monkeypatch):
    # A read of a settled context is its tool's read and the call's accounting (a store
    # asks for its chunks one at a time); one call in sample_every takes the full path and
    # is timed; a short read is the file's error on either path; a failing tool falls back.
    from arrayio.dispatch import batches

    world = exploring({"a": 2 * GB, "b": 1 * GB}, [A, B], 8 * MiB)
    policy = world.dispatcher.policy = make_policy(world.world, [A, B], sample_every=4)
    while (explained := policy.explain(_context_of_read(world))).phase != "exploiting":
        world.read(8 * MiB)
    assert explained.chosen == A.label
    full = []
    real = batches.read_batch_of_files
    monkeypatch.setattr(
        batches, "read_batch_of_files", lambda *a, **k: full.append(1) or real(*a, **k)
    )
    before = world.world.calls["a"]
    counted = {r.label: r.count for r in policy.explain(_context_of_read(world)).arms}["a"]
    for _ in range(8):
        world.read(8 * MiB)
    assert world.world.calls["a"] - before == 8
    assert len(full) == 2  # the timed calls
    timed = {r.label: r.count for r in policy.explain(_context_of_read(world)).arms}["a"]
    assert timed - counted == 2

    tool = policy.tool(A)
    short = lambda fd, buffer, offset, checksum=None: IOFuture.completed(buffer.nbytes - 1)  # noqa: E731
    monkeypatch.setattr(tool, "pread", short)
    for _ in range(4):  # untimed calls and the timed one
        with pytest.raises(TruncatedFileError, match="data.bin"):
            world.dispatcher.read(world.fd, np.empty(8 * MiB, np.uint8), 0, path=str(world.path))
    monkeypatch.undo()

    world.world.fail("a", lambda: ToolUnavailableError("gone"))
    world.read(8 * MiB)
    assert world.dispatcher.last[1] == B


def _context_of_read(world) -> Context:
    return world.dispatcher.batch_context("read", world.fd, [(0, 8 * MiB)], "host", False)
