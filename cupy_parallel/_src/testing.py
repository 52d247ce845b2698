"""Hypothesis strategies and a bit-exact tree comparison for property tests of multi-device code.

Hypothesis is a test dependency: importing this module needs it, ``import cupy_parallel`` does not.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict, defaultdict, deque, namedtuple
from typing import TYPE_CHECKING, Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cupy_parallel._src.arrays import device_of, is_array, to_device
from cupy_parallel._src.devices import as_device
from cupy_parallel._src.devices import devices as platform_devices
from cupy_parallel._src.tree import flatten, key_path, leaves_equal, structure_difference

if TYPE_CHECKING:
    from hypothesis.strategies import DrawFn, SearchStrategy

    from cupy_parallel._src.devices import Device

__all__ = ["arrays", "assert_tree_equal", "devices", "host_values", "nested_structures"]

#: Every dtype that NumPy and CuPy both support, the set ``arrays`` draws from by default.
DTYPES: tuple[np.dtype[Any], ...] = tuple(
    np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
)

#: The namedtuple ``nested_structures`` draws.
Pair = namedtuple("Pair", ["first", "second"])


# --------------------------------------------------------------------------------------------
# arrays


def _as_strategy(value: Any, convert: Any) -> SearchStrategy[Any]:
    if isinstance(value, st.SearchStrategy):
        return value.map(convert)
    return st.just(convert(value))


def _numeric_dtype(spec: Any) -> np.dtype[Any]:
    dtype = np.dtype(spec)
    if dtype.kind not in "biufc":
        raise ValueError(
            f"arrays draws numeric arrays (bool, int, uint, float, complex), got dtype {dtype}."
        )
    return dtype


@st.composite
def _arrays(
    draw: DrawFn,
    *,
    dtype: SearchStrategy[np.dtype[Any]],
    shape: SearchStrategy[tuple[int, ...]],
    finite: bool,
    non_contiguous: bool,
    device: SearchStrategy[Device] | None,
) -> Any:
    dtype_ = draw(dtype)
    shape_ = draw(shape)
    ndim = len(shape_)
    # A view of a larger base: axes permuted, strided (2) and/or reversed (negative steps).
    order = list(range(ndim))
    steps = [1] * ndim
    if non_contiguous and ndim > 0 and draw(st.booleans()):
        order = list(draw(st.permutations(range(ndim))))
        steps = draw(st.lists(st.sampled_from((1, 2, -1, -2)), min_size=ndim, max_size=ndim))
    # base.transpose(order).shape == shape_ when base.shape[order[i]] == shape_[i].
    view_shape = [0] * ndim
    for i, axis in enumerate(order):
        view_shape[axis] = shape_[i]
    base_shape = tuple(n * abs(step) for n, step in zip(view_shape, steps, strict=True))
    base = _values(draw, dtype_, base_shape, finite)
    if device is not None:
        base = to_device(base, draw(device))
    if ndim == 0:
        return base
    return base[tuple(slice(None, None, step) for step in steps)].transpose(order)


def _values(draw: DrawFn, dtype: np.dtype[Any], shape: tuple[int, ...], finite: bool) -> Any:
    if finite and dtype.kind in "fc":
        elements = hnp.from_dtype(dtype, allow_nan=False, allow_infinity=False)
        return draw(hnp.arrays(dtype, shape, elements=elements))
    size = math.prod(shape)
    if dtype.kind == "b":
        bits = draw(st.binary(min_size=size, max_size=size))
        return (np.frombuffer(bits, np.uint8) & 1).astype(bool).reshape(shape)
    bits = draw(st.binary(min_size=size * dtype.itemsize, max_size=size * dtype.itemsize))
    values = np.frombuffer(bits, np.uint8).copy().view(dtype)
    # Uniform bits almost never hit -0.0, infinities or integer extremes: plant a few.
    parts = values.view(_component(dtype)).reshape(-1)
    if parts.size:
        specials = _specials(_component(dtype))
        planted = st.tuples(st.integers(0, parts.size - 1), st.sampled_from(specials))
        for index, special in draw(st.lists(planted, max_size=min(parts.size, 4))):
            parts[index : index + 1] = special
    return values.reshape(shape)


def _component(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The real dtype a complex dtype is made of (the dtype itself otherwise)."""
    return np.dtype(dtype.char.lower()) if dtype.kind == "c" else dtype


@functools.cache
def _specials(dtype: np.dtype[Any]) -> tuple[np.ndarray, ...]:
    """Values at the edges of a real dtype, each as a 1-element array (bit patterns kept)."""
    if dtype.kind == "f":
        info = np.finfo(dtype)
        uint = np.dtype(f"u{dtype.itemsize}")
        exponent_bits = 8 * dtype.itemsize - 1 - info.nmant
        payload_nan = ((1 << exponent_bits) - 1) << info.nmant | 1  # a signalling-NaN payload
        negative_nan = np.array([-np.nan], dtype).view(uint)[0] | 1
        floats = [0.0, -0.0, np.inf, -np.inf, np.nan, info.max, info.smallest_subnormal]
        return (
            *(np.array([v], dtype) for v in floats),
            np.array([payload_nan], uint).view(dtype),
            np.array([negative_nan], uint).view(dtype),
        )
    info_i = np.iinfo(dtype)
    return tuple(np.array([v], dtype) for v in sorted({0, 1, info_i.min, info_i.max}))


def arrays(
    dtype: Any = None,
    shape: Any = None,
    *,
    min_dims: int = 0,
    max_dims: int = 3,
    min_side: int = 0,
    max_side: int = 4,
    finite: bool = False,
    non_contiguous: bool = False,
    device: Any = None,
) -> SearchStrategy[Any]:
    """A strategy for arrays of any dtype, with arbitrary bit patterns, optionally on a device.

    Values are drawn as raw bits, so floating arrays include every NaN payload, ``-0.0``,
    infinities and subnormals (booleans are 0 or 1); ``finite=True`` draws finite floats
    instead. Shapes may have 0-size dimensions.

    Args:
        dtype: A dtype, a strategy of dtypes, or ``None`` for every dtype NumPy and CuPy share
            (bool, signed and unsigned ints of 8-64 bits, float16/32/64, complex64/128).
        shape: A shape, a strategy of shapes, or ``None`` for shapes of ``min_dims``-``max_dims``
            dimensions with ``min_side``-``max_side`` elements each.
        min_dims: Fewest dimensions when ``shape`` is ``None``.
        max_dims: Most dimensions when ``shape`` is ``None``.
        min_side: Smallest dimension size when ``shape`` is ``None``.
        max_side: Largest dimension size when ``shape`` is ``None``.
        finite: Draw only finite floating values.
        non_contiguous: Also draw views that are not C-contiguous (permuted axes, strides of 2,
            negative strides) of a larger array.
        device: Where the arrays live: ``None`` for plain NumPy, a device (``"host:1"``,
            ``"cuda:0"``) or a strategy of devices. Views are taken on the device.

    Returns:
        A hypothesis strategy of arrays.

    Example:
        >>> import numpy as np
        >>> import cupy_parallel
        >>> from hypothesis import given
        >>> @given(arrays(np.float16, (2, 3), non_contiguous=True, device="host:1"))
        ... def test(x):
        ...     assert x.shape == (2, 3) and x.dtype == np.float16
        ...     assert cupy_parallel.device_of(x) == cupy_parallel.Device("host", 1)
        >>> test()
    """
    dtypes = st.sampled_from(DTYPES) if dtype is None else _as_strategy(dtype, _numeric_dtype)
    if shape is None:
        shapes = hnp.array_shapes(
            min_dims=min_dims, max_dims=max_dims, min_side=min_side, max_side=max_side
        )
    else:
        shapes = _as_strategy(shape, lambda s: (s,) if isinstance(s, int) else tuple(s))
    places = None if device is None else _as_strategy(device, as_device)
    return _arrays(
        dtype=dtypes, shape=shapes, finite=finite, non_contiguous=non_contiguous, device=places
    )


# --------------------------------------------------------------------------------------------
# devices


@st.composite
def _device_lists(draw: DrawFn, min_size: int, max_size: int, unique: bool) -> list[Device]:
    available = platform_devices()
    if unique and min_size > len(available):
        raise ValueError(
            f"devices(min_size={min_size}) needs {min_size} distinct devices but the platform "
            f"has {len(available)}; lower min_size or set cupy_parallel.set_host_device_count."
        )
    most = min(max_size, len(available)) if unique else max_size
    return draw(
        st.lists(st.sampled_from(available), min_size=min_size, max_size=most, unique=unique)
    )


def devices(
    *, min_size: int = 1, max_size: int = 8, unique: bool = True
) -> SearchStrategy[list[Device]]:
    """A strategy for lists of the platform's devices in random order.

    On the host platform these are ``host:k`` devices (how many exist is read when each example
    is drawn, see :func:`cupy_parallel.set_host_device_count`); on the CUDA platform, GPUs. With
    ``unique=True`` a list never repeats a device and is at most as long as the platform has
    devices.

    Args:
        min_size: Fewest devices in a list.
        max_size: Most devices in a list.
        unique: Whether a list may repeat a device.

    Returns:
        A hypothesis strategy of lists of :class:`~cupy_parallel.Device`.

    Raises:
        ValueError: The sizes are not ``1 <= min_size <= max_size`` (checked here), or, when a
            list is drawn, the platform has fewer than ``min_size`` devices and ``unique``.

    Example:
        >>> from hypothesis import given
        >>> @given(devices(min_size=2, max_size=3))
        ... def test(ds):
        ...     assert 2 <= len(ds) <= 3 and len(set(ds)) == len(ds)
        >>> test()
    """
    if not 1 <= min_size <= max_size:
        raise ValueError(
            f"devices needs 1 <= min_size <= max_size, got min_size={min_size}, "
            f"max_size={max_size}."
        )
    return _device_lists(min_size, max_size, unique)


# --------------------------------------------------------------------------------------------
# nested structures

_KEYS = st.text(alphabet="abcdefgh", min_size=1, max_size=3)
# The special floats by name too: st.floats draws NaN rarely (one tree in thousands held one),
# and NaN is the leaf that tree comparisons get wrong.
_OTHER_LEAVES = st.one_of(
    st.integers(-5, 5),
    st.text(max_size=3),
    st.floats(width=32),
    st.sampled_from([math.nan, -0.0, math.inf, -math.inf]),
    st.booleans(),
)


@st.composite
def _deques(draw: DrawFn, children: SearchStrategy[Any]) -> deque[Any]:
    items = draw(st.lists(children, max_size=3))
    maxlen = draw(st.none() | st.integers(len(items), len(items) + 2))
    return deque(items, maxlen=maxlen)


def _containers(children: SearchStrategy[Any]) -> SearchStrategy[Any]:
    items = st.dictionaries(_KEYS, children, max_size=3)
    return st.one_of(
        st.lists(children, max_size=3).map(tuple),
        st.lists(children, max_size=3),
        items,
        st.builds(Pair, children, children),
        items.map(lambda d: OrderedDict(reversed(d.items()))),
        items.map(lambda d: defaultdict(list, d)),
        _deques(children),
    )


def nested_structures(
    leaves: SearchStrategy[Any],
    *,
    max_leaves: int = 8,
    none: bool = True,
    other_leaves: bool = True,
) -> SearchStrategy[Any]:
    """A strategy for random nested containers of ``leaves``, ``None`` and non-array values.

    Containers are tuple, list, dict, a namedtuple (``Pair``), ``OrderedDict`` (keys not in
    sorted order), ``defaultdict(list)`` and ``deque`` (with and without ``maxlen``), nested to any
    depth. A bare leaf is a structure too.

    Args:
        leaves: The strategy for the main leaves, e.g. :func:`arrays`.
        max_leaves: A bound on the number of leaves in a structure (hypothesis's
            ``recursive`` bound).
        none: Whether ``None`` appears among the leaves.
        other_leaves: Whether small ints, floats (NaN included), bools and strings appear among
            the leaves.

    Returns:
        A hypothesis strategy of structures.

    Example:
        >>> import numpy as np
        >>> import optree
        >>> from hypothesis import given
        >>> @given(nested_structures(arrays(np.int8, (2,)), other_leaves=False))
        ... def test(tree):
        ...     leaves = optree.tree_leaves(tree, namespace="cupy_parallel")
        ...     assert all(leaf.shape == (2,) for leaf in leaves)
        >>> test()
    """
    extras = [st.none()] * none + [_OTHER_LEAVES] * other_leaves
    # Half the leaves come from ``leaves``: a mapped one_of is not flattened into the outer one.
    base = st.one_of(leaves, st.one_of(extras).map(_same)) if extras else leaves
    return st.recursive(base, _containers, max_leaves=max_leaves)


def _same(x: Any) -> Any:
    return x


# --------------------------------------------------------------------------------------------
# assert_tree_equal


def host_values(leaf: Any) -> Any:
    """An array leaf as a NumPy array on the host (a copy for device arrays); others as they are.

    Example:
        >>> host_values(np.arange(2)), host_values(1.5)
        (array([0, 1]), 1.5)
    """
    if not is_array(leaf):
        return leaf
    plain = leaf.get() if hasattr(leaf, "get") and not isinstance(leaf, np.ndarray) else leaf
    return np.asarray(plain)


def _host_bits(array: Any) -> np.ndarray:
    """The array's elements as rows of raw bytes, in C order, on the host."""
    flat = np.ascontiguousarray(host_values(array)).reshape(-1)
    return flat.view(np.uint8).reshape(flat.size, array.dtype.itemsize)


def _array_difference(actual: Any, expected: Any, check_device: bool) -> str | None:
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != {expected.dtype}"
    if actual.shape != expected.shape:
        return f"shape {actual.shape} != {expected.shape}"
    if check_device and device_of(actual) != device_of(expected):
        return f"device {device_of(actual)} != {device_of(expected)}"
    bits_a, bits_e = _host_bits(actual), _host_bits(expected)
    differs = (bits_a != bits_e).any(axis=1)
    if not differs.any():
        return None
    first = int(np.argmax(differs))
    index = tuple(int(i) for i in np.unravel_index(first, actual.shape))
    value_a = np.asarray(bits_a[first]).view(actual.dtype)[0]
    value_e = np.asarray(bits_e[first]).view(actual.dtype)[0]
    return (
        f"{int(differs.sum())} of {differs.size} elements differ in their bits; the first at "
        f"index {index}: {value_a!r} (0x{bits_a[first][::-1].tobytes().hex()}) != "
        f"{value_e!r} (0x{bits_e[first][::-1].tobytes().hex()})"
    )


def assert_tree_equal(actual: Any, expected: Any, /, *, check_device: bool = True) -> None:
    """Assert two structures are the same: same containers, and leaves bit-exactly equal.

    Arrays must have the same dtype, shape and bits (so NaN payloads and ``-0.0`` count, and a
    NaN equals itself), and by default live on the same device; strides do not matter. Other
    leaves must be of one type and equal (NaN floats equal each other). Containers compare with
    their metadata (namedtuple type, ``defaultdict`` factory, ``deque`` maxlen, ``OrderedDict``
    order, registered nodes); plain ``dict`` key order does not matter, as with ``==``.

    Args:
        actual: The structure under test.
        expected: The structure it should equal.
        check_device: Also require every array pair to live on the same device.

    Raises:
        AssertionError: At the first difference, naming its key path.

    Example:
        >>> import numpy as np
        >>> assert_tree_equal({"a": [1.5, np.zeros(2)]}, {"a": [1.5, np.zeros(2)]})
        >>> assert_tree_equal({"a": [np.zeros(2)]}, {"a": [-np.zeros(2)]})
        Traceback (most recent call last):
        ...
        AssertionError: Trees differ at ['a'][0]: 2 of 2 elements differ in their bits; ...
    """
    accessors, leaves_a, spec_a = flatten(actual)
    _, leaves_e, spec_e = flatten(expected)
    difference = structure_difference(spec_a, spec_e)
    if difference is not None:
        where, node_a, node_e = difference
        raise AssertionError(
            f"Trees differ in structure at {where}: actual has {node_a}, expected has {node_e}."
        )
    for accessor, a, e in zip(accessors, leaves_a, leaves_e, strict=True):
        where = key_path(accessor)
        if is_array(a) != is_array(e):
            raise AssertionError(
                f"Trees differ at {where}: actual is {type(a).__name__}, expected "
                f"{type(e).__name__}."
            )
        if is_array(a):
            problem = _array_difference(a, e, check_device)
            if problem is not None:
                raise AssertionError(f"Trees differ at {where}: {problem}.")
        elif not leaves_equal(a, e):
            raise AssertionError(f"Trees differ at {where}: {a!r} != {e!r}.")
