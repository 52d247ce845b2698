"""The race checker against an independent oracle: explicit happens-before graphs.

Hypothesis draws random programs of reads, writes, event records and waits, and host
synchronisations on four streams of one GPU (the legacy null stream, a blocking stream and two
non-blocking ones) over two arrays. The oracle builds CUDA's happens-before graph explicitly
(stream order, record -> wait edges, the legacy null stream's implicit edges to and from blocking
streams, host synchronisation) and finds the first access that conflicts with an earlier access
it is not reachable from. The simulator must raise ``RaceError`` exactly there, and nowhere
before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from cupy_parallel.testing import RaceError, simulated_cuda

STREAMS = ("legacy", "blocking", "non-blocking-a", "non-blocking-b")
ARRAYS = 2

operations = st.one_of(
    st.tuples(
        st.just("access"),
        st.integers(0, 3),
        st.integers(0, ARRAYS - 1),
        st.booleans(),
    ),
    st.tuples(st.just("record"), st.integers(0, 3)),
    st.tuples(st.just("wait"), st.integers(0, 3), st.integers(0, 7)),
    st.tuples(st.just("sync"), st.integers(0, 3)),
)


@dataclass
class Oracle:
    """CUDA's happens-before graph, built node by node; ancestors as sets of node ids."""

    ancestors: list[set[int]] = field(default_factory=list)
    last: dict[int, int] = field(default_factory=dict)  # stream -> its last node
    host: set[int] = field(default_factory=set)  # nodes the host has waited for
    events: list[int] = field(default_factory=list)  # recorded events -> their record node
    accesses: list[list[tuple[int, bool]]] = field(
        default_factory=lambda: [[] for _ in range(ARRAYS)]
    )

    def node(self, stream: int) -> int:
        """A new operation on ``stream``: after its stream, the host, and the implicit syncs."""
        before = set(self.host)
        preds = [self.last.get(stream)]
        if STREAMS[stream] == "legacy":
            preds.append(self.last.get(STREAMS.index("blocking")))
        elif STREAMS[stream] == "blocking":
            preds.append(self.last.get(STREAMS.index("legacy")))
        for p in preds:
            if p is not None:
                before |= self.ancestors[p] | {p}
        self.ancestors.append(before)
        self.last[stream] = len(self.ancestors) - 1
        return self.last[stream]

    def racy(self, node: int, array: int, write: bool) -> bool:
        """Whether this access conflicts with an earlier one it does not come after."""
        earlier = list(self.accesses[array])
        self.accesses[array].append((node, write))
        return any(
            (write or was_write) and past not in self.ancestors[node] for past, was_write in earlier
        )


def run(cupy: Any, program: list[tuple[Any, ...]]) -> tuple[int | None, int | None]:
    """(index of the op where the simulator raised, where the oracle says the first race is)."""
    streams = [
        cupy.cuda.Stream.null,
        cupy.cuda.Stream(),
        cupy.cuda.Stream(non_blocking=True),
        cupy.cuda.Stream(non_blocking=True),
    ]
    arrays = [cupy.empty(8, np.float64) for _ in range(ARRAYS)]
    scratch = [cupy.empty(8, np.float64) for _ in STREAMS]  # each written on its stream only
    cupy.cuda.Device(0).synchronize()  # the allocations start clean
    events: list[Any] = []
    oracle = Oracle()
    expected = None
    for i, operation in enumerate(program):
        kind, s = operation[0], operation[1]
        stream = streams[s]
        try:
            if kind == "access":
                array, write = operation[2], operation[3]
                node = oracle.node(s)
                if expected is None and oracle.racy(node, array, write):
                    expected = i
                if write:
                    arrays[array].data.memset_async(i % 256, 64, stream)
                else:
                    scratch[s].data.copy_from_device_async(arrays[array].data, 64, stream)
            elif kind == "record":
                oracle.events.append(oracle.node(s))
                events.append(stream.record())
            elif kind == "wait":
                event = operation[2]
                if event < len(events):
                    node = oracle.node(s)
                    record = oracle.events[event]
                    oracle.ancestors[node] |= oracle.ancestors[record] | {record}
                    stream.wait_event(events[event])
            else:
                if s in oracle.last:
                    waited = oracle.last[s]
                    oracle.host |= oracle.ancestors[waited] | {waited}
                stream.synchronize()
        except RaceError:
            return i, expected
    return None, expected


@given(st.lists(operations, max_size=25))
@example([("access", 0, 0, True), ("access", 1, 0, False)])  # legacy, then blocking: ordered
@example([("access", 1, 0, True), ("access", 0, 0, False)])  # blocking, then legacy: ordered
@example([("access", 0, 0, True), ("access", 2, 0, False)])  # legacy, non-blocking: a race
@example([("access", 2, 0, True), ("sync", 2), ("access", 3, 0, False)])  # the host waited
@example([("access", 2, 1, False), ("record", 2), ("access", 2, 1, True), ("wait", 3, 0)])
def test_races_are_reported_exactly_where_the_happens_before_graph_has_them(
    program: list[tuple[Any, ...]],
) -> None:
    with simulated_cuda(1) as cupy:
        raised, expected = run(cupy, program)
    assert raised == expected


def test_the_oracle_sees_a_race_in_a_known_program() -> None:
    program = [("access", 2, 0, True), ("access", 3, 0, False)]  # two non-blocking streams
    with simulated_cuda(1) as cupy:
        assert run(cupy, program) == (1, 1)
    ordered = [("access", 2, 0, True), ("record", 2), ("wait", 3, 0), ("access", 3, 0, False)]
    with simulated_cuda(1) as cupy:
        assert run(cupy, ordered) == (None, None)
