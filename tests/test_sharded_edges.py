"""FullyShardedDataParallel as a user porting torch code drives it, on thread ranks.

The oracle is a one-process run: the loss of every rank's batch on the whole parameters, on a
plain tape, averaged over the ranks (DDP's gradient), and a plain optimizer stepping it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import cupy_parallel as cp
from cupy_parallel import distributed as dist
from cupy_parallel import ops
from cupy_parallel._src.tree import flatten_with_names, tree_map
from cupy_parallel.optim import Adam

WORLD = 3
RNG = np.random.default_rng(3)
PARAMS = {
    "a": {"w": RNG.normal(size=(3, 4)), "b": RNG.normal(size=4)},
    "b": {"w": RNG.normal(size=(4, 2)), "s": np.array(0.5)},
    "c": {"w": RNG.normal(size=(4, 2))},
}
XS = [RNG.normal(size=(2, 3)) for _ in range(WORLD)]


def _copy(tree: Any) -> Any:
    return tree_map(np.copy, tree)


def _leaves(tree: Any) -> list[Any]:
    return flatten_with_names(tree, "p")[1]


def _head(units: Any, x: Any, use_c: bool) -> Any:
    h = ops.tanh(ops.add(ops.matmul(x, units["a"]["w"]), units["a"]["b"]))
    return ops.sum(ops.matmul(h, units["c" if use_c else "b"]["w"]))


def _plain_gradient(loss_of: Any, params: Any, xs: list[Any] = XS) -> Any:
    """DDP's gradient: every rank's batch (``xs``) on the whole parameters, averaged."""
    grads = []
    for x in xs:
        with cp.Tape() as tape:
            tape.watch(params)
            loss = loss_of(params, x)
        grads.append(tape.gradient(loss, params))
    _, first, spec = flatten_with_names(grads[0], "g")
    columns = zip(first, *(_leaves(g) for g in grads[1:]), strict=True)
    return spec.unflatten([np.asarray(sum(column) / WORLD) for column in columns])


def _whole(shards: list[Any], like: Any) -> Any:
    """The ranks' gradient shards of one leaf put together (padding dropped)."""
    rows = like.shape[0] if like.ndim else 1
    return np.concatenate([np.atleast_1d(s) for s in shards])[:rows].reshape(like.shape)


def test_units_read_by_condition_change_between_calls() -> None:
    """A head chosen per call (alike on every rank): Adam's parameters equal the plain run's."""
    params = _copy(PARAMS)
    optimizer = Adam(params, lr=0.1)
    for step in range(4):
        optimizer.step(_plain_gradient(lambda p, x, s=step: _head(p, x, s % 2 == 1), params))

    def rank(r: int, reshard: bool) -> Any:
        fsdp = cp.FullyShardedDataParallel(_head, _copy(PARAMS), reshard_after_forward=reshard)
        adam = Adam(fsdp.params, lr=0.1)
        for step in range(4):
            with cp.Tape() as tape:
                loss = fsdp(XS[r], step % 2 == 1)
            adam.step(tape.gradient(loss, fsdp.params))
        return [fsdp.full_params(to=q) for q in range(WORLD)]

    for reshard in (True, False):
        results = dist.spawn(rank, WORLD, (reshard,), timeout=60)
        for r, fulls in enumerate(results):
            for q, full in enumerate(fulls):
                if q != r:
                    assert full is None
                    continue
                for got, want in zip(_leaves(full), _leaves(params), strict=True):
                    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_units_read_differently_by_the_ranks_raise_on_every_rank() -> None:
    """Seen before: rank 1 reading unit c where rank 0 read b (one layout) exchanged their
    shards without an error (rank 1's loss -1.37, from rank 0's rows of b and its own of c)."""
    same = {"a": PARAMS["a"], "b": {"w": PARAMS["b"]["w"]}, "c": PARAMS["c"]}  # b, c alike
    message = (
        r"read different units on different ranks \(rank 0 gathered "
        r"\[\"params\['a'\]\", \"params\['b'\]\"\], rank 1 \[\"params\['a'\]\", "
        r"\"params\['c'\]\"\]"
    )

    def rank(r: int) -> str:
        fsdp = cp.FullyShardedDataParallel(_head, _copy(same))
        with pytest.raises(ValueError, match=message):
            fsdp(XS[r], r == 1)
        with cp.Tape() as tape:  # the same reads on every rank work on afterwards
            loss = fsdp(XS[r], True)
        return str(tape.gradient(loss, fsdp.params)["c"]["w"].shape)

    assert dist.spawn(rank, 2, timeout=60) == ["(2, 2)", "(2, 2)"]


def test_a_gathered_parameter_returned_by_fn_keeps_its_gradient() -> None:
    def fn(units: Any, x: Any) -> Any:
        w = units["a"]["w"]
        return ops.sum(ops.matmul(ops.tanh(ops.matmul(x, w)), units["b"]["w"])), w

    def whole(p: Any, x: Any) -> Any:
        loss, w = fn(p, x)
        return ops.add(loss, ops.sum(ops.square(w)))

    want = _plain_gradient(whole, PARAMS)

    def rank(r: int) -> Any:
        fsdp = cp.FullyShardedDataParallel(fn, _copy(PARAMS))
        with cp.Tape() as tape:
            loss, w = fsdp(XS[r])
            loss = ops.add(loss, ops.sum(ops.square(w)))
        return tape.gradient(loss, fsdp.params)["a"]["w"]

    got = _whole(dist.spawn(rank, WORLD, timeout=60), want["a"]["w"])
    np.testing.assert_allclose(got, want["a"]["w"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("persistent", [False, True], ids=["one_pass", "two_passes"])
def test_a_unit_one_rank_keeps_is_gathered_again_by_every_rank(persistent: bool) -> None:
    """Rank 0's fn keeps a's arrays (its swap is undone there), the other ranks' let go.

    Seen before (CI, under load: a reference cycle not yet collected on one rank did the same):
    the ranks that had swapped a out gathered it again in the backward pass while rank 0 went
    on to reduce-scatter, a collective against another (simulated NCCL: "reduceScatter by rank
    0 meets allGather by rank 1"; a real GPU hangs or mixes the buffers). Also a node holding
    both units' arrays (wrapped by both swaps) gives a's take-back an inner wrapper to remove.
    """

    def fn(units: Any, x: Any, kept: list[Any] | None) -> Any:
        a = units["a"]
        if kept is not None:
            kept.append(a["w"])  # held past the call, used by nothing recorded
        h = ops.tanh(ops.add(ops.matmul(x, a["w"]), a["b"]))
        b = units["b"]["w"]
        both = ops.sum(ops.multiply(a["b"], b[:, 0]))  # one node, arrays of a and b
        return ops.add(ops.sum(ops.matmul(h, b)), both)

    want = _plain_gradient(lambda p, x: fn(p, x, None), PARAMS)

    def rank(r: int) -> Any:
        fsdp = cp.FullyShardedDataParallel(fn, _copy(PARAMS))
        fsdp._trace = []
        kept: list[Any] | None = [] if r == 0 else None
        with cp.Tape(persistent=persistent) as tape:
            loss = fsdp(XS[r], kept)
        grads = [tape.gradient(loss, fsdp.params) for _ in range(1 + persistent)]
        events = [e for e in fsdp._trace if "regather" in e[0]]
        return grads, events

    results = dist.spawn(rank, WORLD, timeout=60)
    for r, (_, events) in enumerate(results):  # a: taken back by all; b: swapped out by all
        passes = [("regather issued", 1)] * (2 if persistent else 1)
        assert events == [("regather to agree issued", 0), *passes], (r, events)
    for k in ("a", "b"):
        for i, like in enumerate(_leaves(want[k])):
            for p in range(1 + persistent):
                got = _whole([_leaves(res[0][p][k])[i] for res in results], like)
                np.testing.assert_allclose(got, like, rtol=0, atol=1e-12)


@pytest.mark.parametrize("reshard", [True, False], ids=["full_shard", "shard_grad_op"])
def test_micro_batches_in_one_tape_add_up(reshard: bool) -> None:
    """Two forward calls before one gradient (accumulation), units read in a loop."""

    def fn(units: Any, x: Any) -> Any:
        h, out = x, None
        for i in range(3):
            h = ops.tanh(ops.add(ops.matmul(h[:, :3], units["a"]["w"]), units["a"]["b"]))
            term = ops.sum(ops.matmul(h, units["b" if i % 2 else "c"]["w"]))
            out = term if out is None else ops.add(out, term)
        return out

    want = _plain_gradient(lambda p, x: ops.add(fn(p, x), fn(p, ops.multiply(x, 2.0))), PARAMS)

    def rank(r: int) -> Any:
        fsdp = cp.FullyShardedDataParallel(fn, _copy(PARAMS), reshard_after_forward=reshard)
        with cp.Tape() as tape:
            loss = ops.add(fsdp(XS[r]), fsdp(ops.multiply(XS[r], 2.0)))
        return tape.gradient(loss, fsdp.params)

    results = dist.spawn(rank, WORLD, timeout=60)
    for k in PARAMS:
        for i, like in enumerate(_leaves(want[k])):
            got = _whole([_leaves(res[k])[i] for res in results], like)
            np.testing.assert_allclose(got, like, rtol=0, atol=1e-12)


def test_zero_over_fsdp_shards_is_refused() -> None:
    """Seen before: ZeroRedundancyOptimizer(fsdp.params, SGD) broadcast each owner's shards
    over the other ranks' (different) shards: after one step the gathered parameters were
    not the plain SGD's over fsdp.params."""
    from cupy_parallel.distributed.optim import ZeroRedundancyOptimizer
    from cupy_parallel.optim import SGD

    def rank(r: int) -> str:
        fsdp = cp.FullyShardedDataParallel(_head, _copy(PARAMS))
        with pytest.raises(
            ValueError,
            match=r"Parameter 0 of param group 0 \(shape \(2,\)\) is a shard of a FullyS",
        ):
            ZeroRedundancyOptimizer(fsdp.params, SGD, lr=0.1)
        return str(SGD(fsdp.params, lr=0.1).param_groups[0]["lr"])

    assert dist.spawn(rank, WORLD, timeout=60) == ["0.1"] * WORLD


@pytest.mark.parametrize("reshard", [True, False], ids=["full_shard", "shard_grad_op"])
def test_a_write_into_a_kept_unit_after_an_undone_swap_raises(reshard: bool) -> None:
    """fn keeps a gathered array (its swap is undone) and a collective writes it in place.

    Seen before with ``reshard_after_forward=True``: no error and the gradient of the written
    values (8.16 where the forward's values give 4.08): the undone swap had dropped the
    array's memory from what the tape watches for in-place writes. A plain tape and
    SHARD_GRAD_OP raise.
    """

    def fn(units: Any, x: Any) -> Any:
        w = units["a"]["b"]
        s = ops.sum(ops.multiply(ops.multiply(w, w), x))
        with cp._src.recording.pause_recording():
            dist.all_reduce(np.zeros(1))  # any in-place write by the library: the tape scans
        t = ops.sum(ops.matmul(units["b"]["w"], x[:2]))  # a's swap is tried, undone (fn has w)
        with cp._src.recording.pause_recording():
            dist.all_reduce(w)  # w written in place
        return ops.add(s, t), w

    def rank(r: int) -> None:
        fsdp = cp.FullyShardedDataParallel(fn, _copy(PARAMS), reshard_after_forward=reshard)
        with cp.Tape() as tape:
            loss, _ = fsdp(np.ones(4))
        with pytest.raises(RuntimeError, match=r"modified in place after ops\.multiply was rec"):
            tape.gradient(loss, fsdp.params)

    dist.spawn(rank, 2, timeout=60)


def test_clipping_fsdp_gradients_without_the_group_raises() -> None:
    """Seen before: clip_grad_norm(fsdp_grads, 1.0) took each rank's shards for the whole
    gradients (a different norm and scale on each rank, none DDP's); the group gives DDP's."""
    want = _plain_gradient(lambda p, x: _head(p, x, False), PARAMS)
    _, total = cp.clip_grad_norm(want, 1.0)

    def rank(r: int) -> float:
        fsdp = cp.FullyShardedDataParallel(_head, _copy(PARAMS))
        with cp.Tape() as tape:
            loss = fsdp(XS[r], False)
        grads = tape.gradient(loss, fsdp.params)
        for part in (grads, {"b": grads["b"]}, {"c": grads["c"]}):  # c: zeros (not read)
            with pytest.raises(ValueError, match="grads holds gradient shards of a FullySh"):
                cp.clip_grad_norm(part, 1.0)
        return float(cp.clip_grad_norm(grads, 1.0, process_group=dist.group.WORLD)[1])

    assert dist.spawn(rank, WORLD, timeout=60) == [pytest.approx(float(total), rel=1e-12)] * 3


@pytest.mark.parametrize("reshard", [True, False], ids=["full_shard", "shard_grad_op"])
def test_a_unit_read_while_the_tape_stops_recording(reshard: bool) -> None:
    """torch's ``with torch.no_grad():`` inside a module: the unit is a constant there.

    Seen before (FULL_SHARD): UnboundLocalError then AssertionError from the forward call,
    the tape having recorded nothing on the unit's gathered arrays.
    """
    tapes: dict[int, Any] = {}  # each rank's tape

    def fn(units: Any, x: Any) -> Any:
        with tapes[dist.get_rank()].stop_recording():
            constant = ops.sum(ops.matmul(x, units["a"]["w"]))
        return ops.multiply(_head(units, x, True), constant)

    def plain(p: Any, x: Any) -> Any:
        return ops.multiply(_head(p, x, True), ops.sum(ops.matmul(x, p["a"]["w"])))

    def rank(r: int) -> Any:
        fsdp = cp.FullyShardedDataParallel(fn, _copy(PARAMS), reshard_after_forward=reshard)
        with cp.Tape() as tape:
            tapes[r] = tape
            loss = fsdp(XS[r])
        return tape.gradient(loss, fsdp.params)["c"]["w"]

    want = np.zeros((4, 2))
    for x in XS:  # the plain tape's gradient of c: the constant is a number there too
        p = _copy(PARAMS)
        with cp.Tape() as tape:
            tape.watch(p["c"])
            loss = plain(p, x)
        want += tape.gradient(loss, p["c"])["w"] / WORLD
    got = _whole(dist.spawn(rank, WORLD, timeout=60), want)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_full_params_refuses_to_run_while_a_tape_records() -> None:
    """Seen before: full_params() inside a tape was not recorded, so a loss built from it got
    no gradient through those parameters (zeros, no error); outside it equals the parameters."""

    def rank(r: int) -> None:
        fsdp = cp.FullyShardedDataParallel(_head, _copy(PARAMS))
        with cp.Tape() as tape:
            with pytest.raises(RuntimeError, match=r"full_params\(\) is not recorded"):
                fsdp.full_params()
            with tape.stop_recording():
                inside = fsdp.full_params()
        outside = fsdp.full_params()
        for want, got, again in zip(
            _leaves(PARAMS), _leaves(inside), _leaves(outside), strict=True
        ):
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(again, want)

    dist.spawn(rank, 2, timeout=60)


def test_units_swapped_out_at_different_points_are_gathered_again_in_one_order() -> None:
    """A node holds arrays of units a and b (one layout); rank 0's fn holds a while it reads c.

    Seen before: no error, and gradients of a and b off by up to 2.10: rank 0 swapped a out
    when fn returned, the others when it read c, so the node was wrapped by a's swap then b's
    on one rank and the other way round on the others; the backward pass gathered a again on
    rank 0 while the others gathered b, and the two all-gathers of one size swapped rows.
    """
    rng = np.random.default_rng(5)
    params = {"a": {"w": rng.normal(size=(4, 2))}, "b": {"w": rng.normal(size=(4, 2))}}
    params["c"] = {"w": rng.normal(size=(4, 1))}
    xs = [rng.normal(size=(3, 4)) for _ in range(WORLD)]

    def body(p: Any, x: Any) -> Any:
        h = ops.tanh(ops.matmul(x, p["a"]["w"]))
        out = ops.sum(ops.matmul(h, ops.transpose(p["b"]["w"])))
        both = ops.multiply(p["a"]["w"], p["b"]["w"])  # the last node holding a's or b's arrays
        return h, ops.add(out, ops.sum(both))

    def fn(units: Any, x: Any, hold: bool) -> Any:
        a, b = units["a"], units["b"]
        h, out = body({"a": a, "b": b}, x)
        held = a if hold else None  # rank 0 lets go of a only when fn returns
        del a, b
        out = ops.add(out, ops.sum(ops.multiply(h, ops.sum(units["c"]["w"]))))
        del held
        return out

    want = _plain_gradient(lambda p, x: fn(p, x, False), params, xs)

    def rank(r: int) -> Any:
        fsdp = cp.FullyShardedDataParallel(fn, _copy(params))
        with cp.Tape() as tape:
            loss = fsdp(xs[r], r == 0)
        return tape.gradient(loss, fsdp.params)

    results = dist.spawn(rank, WORLD, timeout=60)
    for k, like in want.items():
        got = _whole([res[k]["w"] for res in results], like["w"])
        np.testing.assert_allclose(got, like["w"], rtol=0, atol=1e-12)


class _Pair(cp.Function):
    """Two new arrays of one input (a node of two outputs, neither a view of the input)."""

    @staticmethod
    def forward(ctx: Any, w: Any) -> Any:
        return w * 2.0, w * 3.0

    @staticmethod
    def backward(ctx: Any, g: Any, h: Any) -> Any:
        return sum(f * d for f, d in ((2.0, g), (3.0, h)) if d is not None)


@pytest.mark.parametrize("last", ["one_output", "two_outputs"])
def test_a_head_one_ranks_loss_leaves_out_is_gathered_again_by_every_rank(last: str) -> None:
    """A second head on unit c whose loss rank 1 leaves out (no labels for it in its batch).

    Seen before (FULL_SHARD): the ranks whose loss used the head gathered c again in the
    backward pass (its first node a gradient reached) while rank 1, reached by none, went on
    to reduce-scatter c: "rank 0: all_gather; rank 1: reduce_scatter" (a real GPU hangs or
    mixes the buffers). Now a swap's last node gathers its unit again on every pass; with
    two outputs, the reverse pass skipped that node where no gradient came.
    """

    def fn(units: Any, x: Any) -> Any:
        a = units["a"]
        h = ops.tanh(ops.add(ops.matmul(x, a["w"]), a["b"]))
        del a
        b = units["b"]
        main = ops.sum(ops.multiply(ops.matmul(h, b["w"]), b["s"]))
        del b
        w = units["c"]["w"]
        if last == "one_output":
            return main, ops.sum(ops.matmul(h, w))
        p, q = _Pair.apply(w)  # the last node holding c's array
        return main, ops.add(ops.sum(p), ops.sum(ops.matmul(h, q)))

    def loss_of(out: Any, r: int) -> Any:
        main, side = out
        return main if r == 1 else ops.add(main, side)

    want = {k: [np.zeros_like(a) for a in _leaves(v)] for k, v in PARAMS.items()}
    for r, x in enumerate(XS):
        p = _copy(PARAMS)
        with cp.Tape() as tape:
            tape.watch(p)
            loss = loss_of(fn(p, x), r)
        for k, g in tape.gradient(loss, p).items():
            for total, leaf in zip(want[k], _leaves(g), strict=True):
                np.add(total, leaf / WORLD, out=total)

    def rank(r: int) -> Any:
        fsdp = cp.FullyShardedDataParallel(fn, _copy(PARAMS))
        with cp.Tape() as tape:
            loss = loss_of(fsdp(XS[r]), r)
        return tape.gradient(loss, fsdp.params)

    results = dist.spawn(rank, WORLD, timeout=60)
    for k, likes in want.items():
        for i, like in enumerate(likes):
            got = _whole([_leaves(res[k])[i] for res in results], like)
            np.testing.assert_allclose(got, like, rtol=0, atol=1e-12)


def test_a_refused_reduction_of_a_swapped_unit_the_loss_does_not_use() -> None:
    """``functional.all_reduce(w, ReduceOp.PRODUCT)`` of a gathered weight, kept for logging only.

    Seen before (FULL_SHARD): gradient() raised "all_reduce with ReduceOp.PRODUCT has no
    gradient here" though the loss does not use the product (the plain tape and SHARD_GRAD_OP
    do not raise): the swap's wrapper gave the refused reduction zeros, not "no gradient".
    """
    from cupy_parallel.distributed import ReduceOp
    from cupy_parallel.distributed.nn import functional

    logged: list[Any] = []

    def fn(units: Any, x: Any) -> Any:
        logged.append(functional.all_reduce(units["a"]["w"], ReduceOp.PRODUCT))
        return _head(units, x, False)

    want = _plain_gradient(lambda p, x: _head(p, x, False), PARAMS)

    def rank(r: int) -> Any:
        fsdp = cp.FullyShardedDataParallel(fn, _copy(PARAMS))
        with cp.Tape() as tape:
            loss = fsdp(XS[r])
        return tape.gradient(loss, fsdp.params)

    results = dist.spawn(rank, WORLD, timeout=60)
    for i, like in enumerate(_leaves(want["a"])):
        got = _whole([_leaves(res["a"])[i] for res in results], like)
        np.testing.assert_allclose(got, like, rtol=0, atol=1e-12)


@pytest.mark.parametrize("where", ["before_c", "after_c"])
def test_a_statistic_rank_0_logs_moves_no_gather_of_the_backward_pass(where: str) -> None:
    """Rank 0 records the norm of unit a's weight (logged, unused by the loss) after a's and
    b's last operations, before or after reading c: a's last node moves on rank 0 only.

    Seen before (with each swap's last node run on every pass, before the ranks compared where
    those nodes fall): no error and a's gradient off by 0.90 (before_c: rank 0 gathered a
    again where the others gathered b, one layout), or "ranks differ in the array they passed"
    (after_c: rank 0 gathered a where the others reduce-scattered c). Now the ranks take the
    call's swaps back (a rank-divergent tape keeps its units gathered; the gradient is right).
    """
    rng = np.random.default_rng(5)
    params = {"a": {"w": rng.normal(size=(4, 2))}, "b": {"w": rng.normal(size=(4, 2))}}
    params["c"] = {"w": rng.normal(size=(4, 1))}
    xs = [rng.normal(size=(3, 4)) for _ in range(WORLD)]

    def fn(units: Any, x: Any, log: list[Any] | None) -> Any:
        a, b = units["a"], units["b"]
        h = ops.tanh(ops.matmul(x, a["w"]))
        g = ops.tanh(ops.matmul(h, ops.transpose(b["w"])))
        out = ops.add(ops.sum(g), ops.sum(ops.multiply(a["w"], 2.0)))  # a's last node
        out = ops.add(out, ops.sum(ops.multiply(b["w"], 3.0)))  # b's last node
        if log is not None and where == "before_c":
            log.append(ops.sum(ops.square(a["w"])))
        out = ops.add(out, ops.sum(ops.matmul(g, units["c"]["w"])))
        if log is not None and where == "after_c":
            log.append(ops.sum(ops.square(a["w"])))
        return out

    want = _plain_gradient(lambda p, x: fn(p, x, None), params, xs)

    def rank(r: int) -> Any:
        fsdp = cp.FullyShardedDataParallel(fn, _copy(params))
        with cp.Tape() as tape:
            loss = fsdp(xs[r], [] if r == 0 else None)
        return tape.gradient(loss, fsdp.params)

    results = dist.spawn(rank, WORLD, timeout=60)
    for k, like in want.items():
        got = _whole([res[k]["w"] for res in results], like["w"])
        np.testing.assert_allclose(got, like["w"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("reshard", [True, False])
def test_a_unit_read_again_on_one_rank_after_resharding_raises_on_every_rank(
    reshard: bool,
) -> None:
    """Rank 0 logs the norm of unit a's weight at the end of ``fn``, the other ranks do not.

    FULL_SHARD: a was resharded when fn read b, so rank 0's read gathers it again alone; its
    all-gather meets the other ranks' comparison of the call, and the group's check of the
    ranks' collectives raises ``ValueError`` on every rank (the guide's rule), not a wrong
    statistic or a hang. SHARD_GRAD_OP: a is still gathered, nothing is issued, and the
    gradient is the plain tape's.
    """
    logged: list[Any] = []

    def fn(units: Any, x: Any, log: bool) -> Any:
        loss = _head(units, x, False)
        if log:
            logged.append(ops.sum(ops.square(units["a"]["w"])))
        return loss

    def rank(r: int) -> Any:
        fsdp = cp.FullyShardedDataParallel(fn, _copy(PARAMS), reshard_after_forward=reshard)
        with cp.Tape() as tape:
            loss = fsdp(XS[r], r == 0)
        return tape.gradient(loss, fsdp.params)

    if reshard:
        # spawn reports the first rank that raised; each names rank 0 as the one that differs
        seen = (
            r"ranks \[0\] differ from the rest in the collective they called \(rank 0: "
            r"all_gather_coalesced; rank 1: all_gather; rank 2: all_gather\)"
        )
        with pytest.raises(RuntimeError, match=seen):
            dist.spawn(rank, WORLD, timeout=60)
        return
    results = dist.spawn(rank, WORLD, timeout=60)
    want = _plain_gradient(lambda p, x: _head(p, x, False), PARAMS)
    for i, like in enumerate(_leaves(want["a"])):
        got = _whole([_leaves(res["a"])[i] for res in results], like)
        np.testing.assert_allclose(got, like, rtol=0, atol=1e-12)


@pytest.mark.parametrize("reshard", [True, False])
def test_a_call_whose_fn_raises_on_every_rank_then_a_retry_on_a_smaller_batch(
    reshard: bool,
) -> None:
    """``fn`` raises ``MemoryError`` after reading every unit (as an out-of-memory batch does, on
    every rank); the loop catches it inside the tape and retries on half the batch. Rank 0's fn
    kept unit a's weight for a statistic (its frame lives on in the traceback).

    Seen before (FULL_SHARD): "rank 0: reduce_scatter; rank 1: all_gather" in gradient(): the
    failed call skipped the ranks' comparison of their swaps, so ranks 1 and 2 gathered a again
    in the backward pass (at the failed call's last node holding it) while rank 0, which had
    kept a, did not (over NCCL without the collective check: a hang or mixed buffers). Now the
    ranks compare the failed call too, and the gradient is the retry's, the plain tape's.
    """
    rng = np.random.default_rng(13)
    params = {k: {"w": rng.normal(size=(4, 4))} for k in "abc"}
    params["d"] = {"w": rng.normal(size=(4, 1))}
    xs = [rng.normal(size=(4, 4)) for _ in range(WORLD)]

    def fn(units: Any, x: Any, keep: bool) -> Any:
        a = units["a"]["w"]
        h = ops.tanh(ops.matmul(x, a))
        kept = a if keep else None  # noqa: F841 (rank 0's statistic, computed later)
        del a
        h = ops.tanh(ops.matmul(h, units["b"]["w"]))
        h = ops.tanh(ops.matmul(h, units["c"]["w"]))
        if x.shape[0] > 2:
            raise MemoryError("out of memory for this batch")
        return ops.sum(ops.matmul(h, units["d"]["w"]))

    want = _plain_gradient(lambda p, x: fn(p, x[:2], False), params, xs)  # the retried batch

    def rank(r: int) -> Any:
        fsdp = cp.FullyShardedDataParallel(fn, _copy(params), reshard_after_forward=reshard)
        with cp.Tape() as tape:
            try:
                loss = fsdp(xs[r], r == 0)
            except MemoryError:
                loss = fsdp(xs[r][:2], r == 0)
        return tape.gradient(loss, fsdp.params)

    results = dist.spawn(rank, WORLD, timeout=60)
    for k, like in want.items():
        got = _whole([res[k]["w"] for res in results], like["w"])
        np.testing.assert_allclose(got, like["w"], rtol=0, atol=1e-12)
