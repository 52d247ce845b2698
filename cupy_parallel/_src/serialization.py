"""``save`` and ``load``: a pytree of arrays and scalars in one safetensors file, atomically.

The format is `safetensors <https://huggingface.co/docs/safetensors>`_ (a dependency of the
package for this): an 8-byte header length, a JSON header naming each tensor's dtype, shape and
byte range, then the raw bytes. It was chosen over ``pickle`` (``numpy.savez`` of objects,
``torch.save``) because reading it never runs code, over a home-made layout because other tools
(``safetensors`` itself, Hugging Face's loaders, Rust and C++ readers) read it, and because its
layout lets the arrays be written from their memory as they are and read with one copy each
(no copy of 1 GiB to write 1 GiB). What safetensors cannot say itself travels in its string
metadata, as JSON under the key ``"cupy_parallel"``: the tree's structure, the Python scalars
and strings in it, each array's device and true dtype.

For speed the bytes are moved here, by the format's documented layout: :func:`write_safetensors`
writes the header and then each array's memory (``safetensors.serialize_file`` took 3.5x as
long for 1 GiB), and a load reads each tensor with one ``readinto`` into a fresh array after
``safetensors.safe_open`` has checked the file (its ``get_tensor`` copies out of a mapping at
twice the cost). safetensors' own reader reads every file written here (tested).

- **Tensors** are named by their key path (``"layer.0.w"``) so that other tools see readable
  names; arrays of a dtype safetensors lacks (``complex128``, ``longdouble``, datetimes, fixed
  strings, big-endian dtypes, ``ml_dtypes`` types such as bfloat16) are stored as their bytes
  (``uint8`` with a last axis of the item size, so that rows still slice) and their true dtype is
  in the metadata. Object, structured and ``StringDType`` arrays hold references, not values:
  ``TypeError``.
- **Scalars**: ``bool``, ``int`` (any size), ``float`` (bit-exact: ``float.hex``, a NaN by its
  bytes), ``complex``, ``str``, ``bytes`` and ``None``; NumPy scalars come back as NumPy
  scalars of their dtype. Anything else is a ``TypeError`` naming its key path: there is no
  pickle, so loading a file can never run code.
- **Containers**: dict, ``OrderedDict``, list, tuple and namedtuples come back as such (dicts in
  their order; a namedtuple as a namedtuple of the same name and fields, made afresh since a file
  must not name code to import). Other nodes (registered classes, ``defaultdict``, ``deque``) are
  saved with their contents and load only into a ``template`` that has them.
- **Atomic**: the file is written under a temporary name in the target's directory, flushed to
  disk (``fsync``), renamed over the target (``os.replace``) and the directory is synced, so that
  a save killed at any moment leaves either the previous file or the new one at ``path``, each
  whole. A killed save can leave its temporary file (``.<name>.<random>.tmp``) behind. The
  previous file's cached pages are dropped before the write (its bytes stay on disk), so that
  the new file reuses their memory (see :func:`replace_atomically`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import secrets
import stat
import struct
from collections import OrderedDict, namedtuple
from typing import TYPE_CHECKING, Any

import numpy as np
import optree

from cupy_parallel._src import tree as _tree
from cupy_parallel._src.arrays import device_of, is_array, move
from cupy_parallel._src.devices import CPU, as_device, check_exists
from cupy_parallel._src.dtypes import check_device_dtype
from cupy_parallel._src.hostarray import HostArray, host_array, plain_buffer

if TYPE_CHECKING:
    from optree import PyTreeAccessor, PyTreeSpec

    from cupy_parallel._src.devices import Device

__all__ = [
    "SCALAR_TYPES",
    "check_savable",
    "decode_array",
    "drop_cached_pages",
    "dtype_name",
    "dtype_of_name",
    "encode_array",
    "encode_tree",
    "fsync_directory",
    "load",
    "read_scalar",
    "replace_atomically",
    "save",
    "scalar_record",
    "storage_tag",
    "write_safetensors",
]

METADATA_KEY = "cupy_parallel"
_FORMAT = "cupy_parallel.save"
_VERSION = 1

# NumPy dtypes safetensors stores as themselves (its NumPy API's table), little-endian
_NATIVE = frozenset(
    np.dtype(c).newbyteorder("<")
    for c in ("f8", "f4", "f2", "i8", "u8", "i4", "u4", "i2", "u2", "i1", "u1", "?", "c8")
)


# --------------------------------------------------------------------------------------------
# Arrays as safetensors tensors (shared with the distributed checkpoint)


def storage_tag(dtype: np.dtype[Any], where: str) -> str | None:
    """``None`` when safetensors stores ``dtype`` itself, else the tag that rebuilds it."""
    if dtype.hasobject or dtype.fields is not None or dtype.kind == "T":
        raise TypeError(
            f"{where} is an array of dtype {dtype}, which holds references or fields rather than "
            "values (object, structured and StringDType arrays cannot be saved without pickle); "
            "convert it to arrays of plain dtypes."
        )
    if dtype.itemsize == 0:
        raise TypeError(f"{where} is an array of dtype {dtype}, whose items have no bytes.")
    if dtype in _NATIVE and dtype.byteorder != ">":
        return None
    if dtype.kind == "V" and dtype.type is not np.void:  # ml_dtypes' types (bfloat16, float8_*)
        return f"ml_dtypes:{dtype.name}"
    return dtype.str


def dtype_of_name(tag: Any) -> np.dtype[Any]:
    """The dtype :func:`dtype_name` wrote, refusing any that holds references (``ValueError``).

    A file names dtypes, so a damaged or crafted one could name ``object``: viewing its bytes
    as references would read arbitrary memory. Only dtypes of values are rebuilt.

    Example:
        >>> dtype_of_name(dtype_name(np.dtype(">c16")))
        dtype('>c16')
    """
    if not isinstance(tag, str):
        raise ValueError(f"a dtype is named by a string, the file has {tag!r}.")
    if tag.startswith("ml_dtypes:"):
        name = tag.removeprefix("ml_dtypes:")
        try:
            ml_dtypes = importlib.import_module("ml_dtypes")
        except ImportError:
            raise TypeError(
                f"the checkpoint holds {name} arrays, which need the ml_dtypes package: "
                "pip install cupy-parallel[bfloat16]."
            ) from None
        kind = getattr(ml_dtypes, name, None) if name.isidentifier() else None
        if kind is None or name.startswith("_"):
            raise ValueError(f"the checkpoint names an unknown ml_dtypes dtype {name!r}.")
        dtype = np.dtype(kind)
        if dtype.kind != "V" or dtype.type is np.void:  # a class of ml_dtypes', not a dtype
            raise ValueError(f"the checkpoint names {name!r}, which is not an ml_dtypes dtype.")
        return dtype
    try:
        dtype = np.dtype(tag)
    except TypeError:
        raise ValueError(f"the file names an unknown dtype {tag!r}.") from None
    if dtype.hasobject or dtype.fields is not None or dtype.kind == "T" or not dtype.itemsize:
        raise ValueError(f"the file names dtype {tag!r}, which does not hold values.")
    return dtype


def check_savable(array: Any, where: str) -> str | None:
    """``array``'s :func:`storage_tag`; ``TypeError`` for what cannot be saved.

    A masked array is refused rather than saved without its mask; other ``ndarray`` subclasses
    (``numpy.matrix``, ``memmap``) are saved as their values and load as plain arrays.

    Example:
        >>> check_savable(np.ma.masked_array([1.0], mask=[True]), "tree['m']")
        Traceback (most recent call last):
        TypeError: tree['m'] is a numpy.ma.MaskedArray; ...
    """
    if isinstance(array, np.ma.MaskedArray):
        raise TypeError(
            f"{where} is a numpy.ma.MaskedArray; saving its values would drop its mask: save "
            "its .data and numpy.ma.getmaskarray() of it as two arrays."
        )
    return storage_tag(np.dtype(array.dtype), where)


def encode_array(array: Any, where: str) -> tuple[np.ndarray, str | None]:
    """A C-contiguous NumPy array safetensors stores, and the tag of ``array``'s true dtype.

    ``array`` (NumPy, HostArray or CuPy) is read as its values (a non-contiguous or Fortran
    array is copied; a CuPy array downloaded). The tag is ``None`` when the dtype is stored as
    itself, else the dtype's bytes are stored (``uint8``, last axis the item size).

    Example:
        >>> stored, tag = encode_array(np.arange(2, dtype=complex), "x")
        >>> stored.dtype, stored.shape, tag
        (dtype('uint8'), (2, 16), '<c16')
    """
    tag = check_savable(array, where)
    if type(array) is HostArray:
        host = plain_buffer(array)
    elif isinstance(array, np.ndarray):
        host = np.asarray(array)  # a subclass's values (reshape and view below are ndarray's)
    else:
        host = move(array, CPU)
    if not host.flags.c_contiguous:  # (numpy.ascontiguousarray would make a 0-d array 1-d)
        host = host.copy(order="C")
    if tag is not None:
        host = host.reshape(-1).view(np.uint8).reshape((*host.shape, host.dtype.itemsize))
    return host, tag


def decode_array(stored: np.ndarray, tag: str | None) -> np.ndarray:
    """The array :func:`encode_array` stored, as a NumPy array of its true dtype (no copy).

    Example:
        >>> x = np.array([1 + 2j, 3j])
        >>> decode_array(*encode_array(x, "x"))
        array([1.+2.j, 0.+3.j])
    """
    if tag is None:
        return stored
    dtype = dtype_of_name(tag)
    if stored.dtype != np.uint8 or stored.ndim == 0 or stored.shape[-1] != dtype.itemsize:
        raise ValueError(
            f"{stored.dtype} bytes of shape {stored.shape} are not items of {dtype} "
            f"({dtype.itemsize} bytes each)."
        )
    if not stored.flags.c_contiguous:
        stored = stored.copy(order="C")
    return stored.reshape(-1).view(dtype).reshape(stored.shape[:-1])


# safetensors' dtype names (its format's documentation) as NumPy's, for the direct reads and writes
_STORED_DTYPES = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "U64": "<u8", "I32": "<i4",
    "U32": "<u4", "I16": "<i2", "U16": "<u2", "I8": "i1", "U8": "u1", "BOOL": "?", "C64": "<c8",
}  # fmt: skip
_STORED_NAMES = {np.dtype(numpy_name): name for name, numpy_name in _STORED_DTYPES.items()}


def _header(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None) -> bytes:
    """The safetensors header of ``tensors`` in this order: length, JSON, spaces to 8 bytes."""
    table: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name, array in tensors.items():
        end = offset + array.nbytes
        table[name] = {
            "dtype": _STORED_NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text


# --------------------------------------------------------------------------------------------
# Atomic files


def fsync_directory(directory: str) -> None:
    """Flush ``directory``'s entries (a rename in it) to disk; nothing where that is impossible."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows cannot open directories
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def drop_cached_pages(path: str) -> None:
    """Evict the regular file ``path``'s clean pages from the page cache; its bytes stay on disk.

    Nothing happens where the system cannot (no ``posix_fadvise``), for a path that is missing
    or not a regular file (a FIFO is never opened), or one that cannot be read.
    """
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_safetensors(
    path: str,
    tensors: dict[str, np.ndarray],
    metadata: dict[str, str] | None,
    *,
    sync: bool = True,
) -> None:
    """Write ``tensors`` (C-contiguous) as a safetensors file at ``path``, flushed to disk.

    The file is the format's documented layout (safetensors' own reader reads it; the tests
    check so): the header, then each array's bytes written from its memory as it is.
    ``safetensors.serialize_file`` writes the same file but took 3.5x the time of a plain
    ``write`` of 1 GiB here, which the 1.2x target of ``numpy.save`` does not leave room for.
    The file's size is reserved first (``posix_fallocate``, where the file system has it): a
    1 GiB ``save`` over the previous file took 1.96 s (0.27 s of CPU) with it, 2.40 s (0.32 s)
    without (medians of 9 interleaved rounds on a shared machine; ``numpy.save`` + ``fsync``
    2.80 s in the same rounds). ``sync=False`` leaves the bytes in
    the page cache (``benchmarks/bench_save.py`` times the ``fsync`` on its own).
    """
    header = _header(tensors, metadata)
    size = len(header) + sum(array.nbytes for array in tensors.values())
    with open(path, "wb") as out:
        if size and hasattr(os, "posix_fallocate"):
            with contextlib.suppress(OSError):  # not every file system can (EOPNOTSUPP)
                os.posix_fallocate(out.fileno(), 0, size)
        out.write(header)
        for array in tensors.values():
            if array.nbytes:
                out.write(array.reshape(-1).view(np.uint8).data)
        out.flush()
        if sync:
            os.fsync(out.fileno())


def replace_atomically(path: str, write: Any) -> None:
    """Call ``write(temporary_path)``, then rename that file over ``path`` and sync the directory.

    A symbolic link at ``path`` is followed (the file it names is replaced, as ``open(path,
    "wb")`` would write it; the link stays). The temporary file sits in that file's directory
    (a rename is atomic within one file system) and gets the permission bits of the file it
    replaces (a file made private stays private), or those a new file gets (``0o666`` less the
    umask); it is removed if ``write`` raises.

    The file being replaced is first dropped from the page cache (:func:`drop_cached_pages`;
    its bytes stay on disk, and at ``path``, until the rename), so that the new file's pages
    reuse its memory instead of taking fresh memory. Fresh memory can be slow to take: on this
    project's virtual machine (whose balloon device reports free pages to the hypervisor, the
    likely cause) a 1 GiB save over the previous 1 GiB file took 1.29 s of CPU (6.3 s wall)
    without the drop, 0.30 s (2.5 s) with it, and ``numpy.save`` + ``fsync``, which truncates
    its previous file before writing, 0.34 s (2.2 s) (medians of 9 rounds, machine shared).
    """
    if not path:
        raise FileNotFoundError("the path to save to is empty ('').")
    target = os.path.realpath(path)
    directory, name = os.path.split(target)
    temporary = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
    os.close(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        drop_cached_pages(target)
        write(temporary)
        with contextlib.suppress(FileNotFoundError):  # after the write: a 0o444 mode stays
            os.chmod(temporary, os.stat(target).st_mode & 0o7777)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    fsync_directory(directory)


# --------------------------------------------------------------------------------------------
# The tree as JSON: {"leaves": [record, ...] in flatten order, "paths": [...], "tree": node}

SCALAR_TYPES = (bool, int, float, complex, str, bytes)


def dtype_name(dtype: np.dtype[Any]) -> str:
    """The text that rebuilds ``dtype`` (``dtype.str``; ``ml_dtypes:<name>`` for ml_dtypes')."""
    if dtype.kind == "V" and dtype.type is not np.void:
        return f"ml_dtypes:{dtype.name}"
    return dtype.str


def _float_text(value: float) -> str:
    """``float.hex``, or for a NaN (whose ``hex`` is ``"nan"``) its 8 bytes: sign and payload."""
    if value != value:  # noqa: PLR0124 - NaN
        return "nan:" + struct.pack("<d", value).hex()
    return value.hex()


def _float_of(text: str) -> float:
    if text.startswith("nan:"):
        raw = bytes.fromhex(text.removeprefix("nan:"))
        if len(raw) != 8:
            raise ValueError(f"{text!r} is not 8 bytes")
        value: float = struct.unpack("<d", raw)[0]
        if value == value:  # noqa: PLR0124 - a damaged file's bytes that are not a NaN
            raise ValueError(f"{text!r} is not a NaN")
        return value
    return float.fromhex(text)


def scalar_record(value: Any) -> dict[str, Any]:
    kind = type(value)
    if kind is bool:
        return {"bool": value}
    if kind is int:  # hexadecimal past 64 bits: str() of an int refuses beyond 4300 digits
        return {"int": str(value) if value.bit_length() < 64 else hex(value)}
    if kind is float:
        return {"float": _float_text(value)}
    if kind is complex:
        return {"complex": [_float_text(value.real), _float_text(value.imag)]}
    if kind is str:
        return {"str": value}
    return {"bytes": value.hex()}


def read_scalar(record: Any) -> tuple[bool, Any]:
    """``(True, value)`` for a scalar record, ``(False, None)`` otherwise (a damaged one too)."""
    if not isinstance(record, dict) or len(record) != 1:
        return False, None
    ((kind, value),) = record.items()
    if kind == "none":
        return value is None, None
    if kind == "bool":
        return type(value) is bool, value if type(value) is bool else None
    if kind == "complex":
        if not (isinstance(value, list) and len(value) == 2):
            return False, None
        real, imag = (read_scalar({"float": part}) for part in value)
        return (True, complex(real[1], imag[1])) if real[0] and imag[0] else (False, None)
    if type(value) is not str:
        return False, None
    try:
        if kind == "int":
            return True, int(value, 0)  # decimal, or "0x..." past 64 bits
        if kind == "float":
            return True, _float_of(value)
        if kind == "bytes":
            return True, bytes.fromhex(value)
    except ValueError:
        return False, None
    return (True, value) if kind == "str" else (False, None)


class _Encoder:
    """The tree's structure and scalars as JSON records, its arrays as named tensors."""

    def __init__(self) -> None:
        self.tensors: dict[str, np.ndarray] = {}

    def _tensor_name(self, accessor: PyTreeAccessor) -> str:
        base = ".".join(str(entry.entry) for entry in accessor) or "tensor"
        if base.startswith("__"):  # safetensors keeps names like "__metadata__" for itself
            base = f"tensor.{base}"
        name, count = base, len(self.tensors)
        while name in self.tensors:
            name, count = f"{base}#{count}", count + 1
        return name

    def leaf(self, value: Any, accessor: PyTreeAccessor) -> dict[str, Any]:
        where = f"tree{_tree.key_path(accessor, '')}" if len(accessor) else "tree"
        if type(value) in SCALAR_TYPES:
            return scalar_record(value)
        if is_array(value) or isinstance(value, np.generic):
            scalar = isinstance(value, np.generic)
            array = np.asarray(value) if scalar else value
            stored, tag = encode_array(array, where)
            name = self._tensor_name(accessor)
            self.tensors[name] = stored
            return {
                "array": name,
                "dtype": dtype_name(np.dtype(array.dtype)),
                "raw": tag is not None,
                "shape": list(array.shape),
                "device": None if scalar else str(device_of(array)),
            }
        kind = type(value)
        raise TypeError(
            f"{where} is a {kind.__module__}.{kind.__qualname__}; save takes arrays (NumPy, host, "
            "CuPy), NumPy scalars, bool, int, float, complex, str, bytes and None in dicts, "
            "lists, tuples and namedtuples. There is no pickle (loading must never run code): "
            "convert the object to those first."
        )

    def node(self, spec: PyTreeSpec, first: int = 0) -> Any:
        """``spec``'s node as JSON; its leaves are records ``first, first + 1, ...``."""
        kind = spec.kind
        if kind == optree.PyTreeKind.LEAF:
            return {"leaf": first}
        if kind == optree.PyTreeKind.NONE:
            return {"none": None}
        children = []
        for child in spec.children():
            children.append(self.node(child, first))
            first += child.num_leaves
        if kind in (optree.PyTreeKind.DICT, optree.PyTreeKind.ORDEREDDICT):
            one_level: Any = spec.one_level()
            order: dict[Any, int] = one_level.unflatten(list(range(len(children))))  # in order
            items = [[_key_record(key), children[index]] for key, index in order.items()]
            return {"dict" if kind == optree.PyTreeKind.DICT else "ordereddict": items}
        if kind in (optree.PyTreeKind.LIST, optree.PyTreeKind.TUPLE):
            return {"list" if kind == optree.PyTreeKind.LIST else "tuple": children}
        cls: Any = spec.type
        if kind == optree.PyTreeKind.NAMEDTUPLE:
            return {"namedtuple": [cls.__name__, list(cls._fields), children]}
        return {"node": [f"{cls.__module__}.{cls.__qualname__}", children]}


def _key_record(key: Any) -> dict[str, Any]:
    if key is None:
        return {"none": None}
    if type(key) not in SCALAR_TYPES:
        raise TypeError(
            f"a dict key is a {type(key).__qualname__} ({key!r}); save takes keys that are "
            "bool, int, float, complex, str, bytes or None."
        )
    return scalar_record(key)


# --------------------------------------------------------------------------------------------
# save


def save(tree: Any, path: str | os.PathLike[str]) -> None:
    """Write ``tree`` (arrays, scalars and strings in dicts, lists, tuples) to ``path``, atomically.

    Arrays keep their dtype, shape, bits and device (NumPy, host or CuPy); a non-contiguous or
    Fortran-ordered array is saved as its values. The file is a safetensors file (see the
    module): nothing is pickled, other tools read the arrays (named by key path, ``"layer.w"``).
    The write is atomic: ``path`` holds the previous file or this one, whole, whenever the
    process is killed.

    Args:
        tree: a pytree (dicts, ``OrderedDict``, lists, tuples, namedtuples, ``None``) of arrays,
            NumPy scalars, ``bool``, ``int``, ``float``, ``complex``, ``str`` and ``bytes``.
        path: the file to write (its directory must exist).

    Raises:
        TypeError: a leaf of another kind, a dict key that is not a scalar, or an array of an
            object or structured dtype (the message names its key path); nothing is written.

    Example:
        >>> import os, tempfile, numpy as np, cupy_parallel as cp
        >>> path = os.path.join(tempfile.mkdtemp(), "state.safetensors")
        >>> cp.save({"w": np.arange(4.0), "step": 3, "name": "run", "best": None}, path)
        >>> cp.load(path)
        {'w': array([0., 1., 2., 3.]), 'step': 3, 'name': 'run', 'best': None}
    """
    path = os.fsdecode(path)
    tensors, metadata = encode_tree(tree)
    replace_atomically(path, lambda temp: write_safetensors(temp, tensors, metadata))


def encode_tree(tree: Any) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """What :func:`save` writes: ``tree``'s arrays as named tensors, the rest as the metadata.

    The tensors are host arrays as :func:`encode_array` gives them (a contiguous NumPy array is
    itself, not a copy); the metadata holds the description of the tree under
    ``"cupy_parallel"``. Raises what :func:`save` raises for a tree it cannot save.

    Example:
        >>> tensors, metadata = encode_tree({"w": np.zeros(2), "step": 3})
        >>> list(tensors), list(metadata)
        (['w'], ['cupy_parallel'])
    """
    accessors, leaves, spec = _tree.flatten(tree)
    encoder = _Encoder()
    records = [encoder.leaf(leaf, at) for at, leaf in zip(accessors, leaves, strict=True)]
    description = {
        "format": _FORMAT,
        "version": _VERSION,
        "leaves": records,
        "paths": [_tree.key_path(accessor, "") for accessor in accessors],
        "tree": encoder.node(spec),
    }
    return encoder.tensors, {METADATA_KEY: json.dumps(description, separators=(",", ":"))}


# --------------------------------------------------------------------------------------------
# load


def _damaged(path: str, what: str) -> ValueError:
    return ValueError(f"{path} is damaged: {what}.")


class _Direct:
    """A safetensors file's tensors read straight into fresh arrays (one copy, as ``numpy.load``).

    ``safe_open`` has checked the file (header, offsets, length) before this reads it; its own
    ``get_tensor`` maps the file and copies out of the mapping, which costs twice the time of a
    ``readinto`` on a warm page cache. The header is the format's documented one: a
    little-endian ``u64`` length, then that many bytes of JSON naming each tensor's dtype,
    shape and byte range after the header.
    """

    def __init__(self, file: Any) -> None:
        self.file = file
        length = int.from_bytes(self.file.read(8), "little")
        self.table = json.loads(self.file.read(length))
        self.start = 8 + length

    def read(self, name: str) -> np.ndarray | None:
        """Tensor ``name`` as a fresh array, or ``None`` for a dtype NumPy has not."""
        entry = self.table[name]
        dtype = _STORED_DTYPES.get(entry["dtype"])
        if dtype is None:
            return None
        out = np.empty(tuple(entry["shape"]), dtype)
        begin, end = entry["data_offsets"]
        if end - begin != out.nbytes:
            raise ValueError(f"holds {end - begin} bytes for {out.nbytes}")
        if out.nbytes:
            self.file.seek(self.start + begin)
            if self.file.readinto(out.reshape(-1).view(np.uint8).data) != out.nbytes:
                raise ValueError("ends early")
        return out

    def close(self) -> None:
        self.file.close()


class _Reader:
    """One open checkpoint: its tensors on demand, placed on their devices."""

    def __init__(
        self, path: str, handle: Any, leaves: list[Any], device: Device | None, direct: _Direct
    ) -> None:
        self.path = path
        self.handle = handle
        self.leaves = leaves
        self.device = device
        self.direct = direct

    def tensor(self, name: str, where: str) -> np.ndarray:
        """Tensor ``name`` of the file as a fresh NumPy array."""
        try:
            stored = self.direct.read(name)
            return self.handle.get_tensor(name) if stored is None else stored
        except Exception as error:  # noqa: BLE001 - safetensors' own error type too
            problem = f"tensor {name!r} ({where}) cannot be read ({error})"
            raise _damaged(self.path, problem) from None

    def array(self, record: dict[str, Any], where: str, device: Device | None) -> Any:
        if not _is_array_record(record):
            raise _damaged(self.path, f"the array record of {where} is malformed")
        name, device_name = record["array"], record["device"]
        stored = self.tensor(name, where)
        try:
            dtype = dtype_of_name(record["dtype"])
            array = decode_array(stored, record["dtype"] if record["raw"] else None)
        except (TypeError, ValueError) as error:
            problem = f"tensor {name!r} ({where}) does not decode as {record['dtype']} ({error})"
            raise _damaged(self.path, problem) from None
        if list(array.shape) != record["shape"] or array.dtype != dtype:
            raise _damaged(
                self.path,
                f"tensor {name!r} ({where}) is {array.dtype} of shape {array.shape}, its record "
                f"says {dtype} of shape {tuple(record['shape'])}",
            )
        if device_name is None:  # a NumPy scalar
            return array[()]
        return self.place(array, device or self.device or as_device(device_name), where)

    def place(self, array: np.ndarray, device: Device, where: str) -> Any:
        if device.kind == "cpu":
            return array
        try:
            check_exists(device)
        except (ValueError, RuntimeError) as error:
            raise ValueError(
                f"{self.path}: {where} was saved on {device}, which this process does not have "
                f"({error}); pass load(..., device=...) to place the arrays elsewhere."
            ) from None
        check_device_dtype(array.dtype, f"{where}'s dtype")
        if device.kind == "host":
            return host_array(array, device)
        return move(array, device)

    def leaf(self, index: Any, where: str, device: Device | None = None) -> Any:
        if type(index) is not int or not 0 <= index < len(self.leaves):
            raise _damaged(self.path, f"the record at {where} names no leaf")
        record = self.leaves[index]
        if isinstance(record, dict) and "array" in record:
            return self.array(record, where, device)
        is_scalar, value = read_scalar(record)
        if not is_scalar:
            raise _damaged(self.path, f"the record of {where} is neither an array nor a scalar")
        return value

    def node(self, record: Any, where: str) -> Any:
        if not isinstance(record, dict) or len(record) != 1:
            raise _damaged(self.path, f"the record at {where} is not a node")
        ((kind, body),) = record.items()
        if kind == "leaf":
            return self.leaf(body, where)
        if kind == "none":
            return None
        if kind in ("dict", "ordereddict"):
            if not (isinstance(body, list) and all(_is_pair(item) for item in body)):
                raise _damaged(self.path, f"the {kind} record at {where} is malformed")
            items = {}
            for key_record, child in body:
                is_scalar, key = (
                    (True, None) if key_record == {"none": None} else read_scalar(key_record)
                )
                if not is_scalar:
                    raise _damaged(self.path, f"a dict key at {where} is not a scalar")
                items[key] = self.node(child, f"{where}[{key!r}]")
            return items if kind == "dict" else OrderedDict(items)
        if kind in ("list", "tuple"):
            if not isinstance(body, list):
                raise _damaged(self.path, f"the {kind} record at {where} is malformed")
            values = [self.node(child, f"{where}[{i}]") for i, child in enumerate(body)]
            return values if kind == "list" else tuple(values)
        if kind == "namedtuple":
            try:
                name, fields, children = body
                if not (isinstance(children, list) and len(children) == len(fields)):
                    raise ValueError("its fields and children differ in number")
                if not all(type(text) is str for text in (name, *fields)):
                    raise ValueError("its name and fields are not strings")
                cls = _namedtuple(name, tuple(fields))
            except (TypeError, ValueError) as error:
                problem = f"the namedtuple at {where} is malformed ({error})"
                raise _damaged(self.path, problem) from None
            pairs = zip(fields, children, strict=True)
            return cls(*(self.node(child, f"{where}.{field}") for field, child in pairs))
        if kind == "node":
            raise ValueError(
                f"{self.path}: {where} is a {body[0]}, which load cannot rebuild without running "
                "code; pass template= (a tree of that structure) to load into its classes."
            )
        raise _damaged(self.path, f"the record at {where} is of unknown kind {kind!r}")


def _is_array_record(record: dict[str, Any]) -> bool:
    kinds: dict[str, type | tuple[type, ...]] = {
        "array": str, "dtype": str, "raw": bool, "shape": list, "device": (str, type(None)),
    }  # fmt: skip
    return all(isinstance(record.get(key, ...), kind) for key, kind in kinds.items())


def _is_pair(item: Any) -> bool:
    return isinstance(item, list) and len(item) == 2


_NAMEDTUPLES: dict[tuple[str, tuple[str, ...]], type] = {}


def _namedtuple(name: str, fields: tuple[str, ...]) -> type:
    """One namedtuple class per name and fields (so that loads of one file share a class)."""
    cls = _NAMEDTUPLES.get((name, fields))
    if cls is None:
        cls = _NAMEDTUPLES[name, fields] = namedtuple(name, fields)
    return cls


def _open(path: str) -> Any:
    from safetensors import safe_open

    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}.")
    try:
        return safe_open(path, framework="np")
    except Exception as error:  # noqa: BLE001 - safetensors' own error type
        raise ValueError(
            f"{path} is not a checkpoint: it does not read as a safetensors file (it is another "
            f"kind of file, or truncated or damaged): {error}"
        ) from None


def _description(path: str, handle: Any) -> dict[str, Any] | None:
    text = (handle.metadata() or {}).get(METADATA_KEY)
    if text is None:
        return None
    try:
        description = json.loads(text)
    except (ValueError, RecursionError):
        description = None
    if not isinstance(description, dict) or description.get("format") != _FORMAT:
        raise ValueError(f"{path}: its {METADATA_KEY!r} metadata is not a cupy_parallel.save tree.")
    if description.get("version") != _VERSION:
        raise ValueError(
            f"{path} was written in format version {description.get('version')!r}; this "
            f"cupy_parallel reads version {_VERSION}."
        )
    return description


def load(path: str | os.PathLike[str], *, device: Any = None, template: Any = None) -> Any:
    """The tree :func:`save` wrote to ``path``, arrays on their devices (or all on ``device``).

    Arrays come back with the dtype, shape and bits they were saved with, C-contiguous and
    writable, each on the device it was saved from (``"cpu"`` arrays as NumPy, ``"host:k"`` as
    HostArray, ``"cuda:k"`` as CuPy) unless ``device`` is given. Reading never runs code. A
    safetensors file another tool wrote loads as a dict of NumPy arrays by tensor name.

    ``template`` (decided here, as flax's ``restore(target=)``): a tree of the structure to load
    into. The result is built with the template's containers (its own namedtuple and registered
    classes), every key path of the template must be in the file and every one of the file in
    the template (``KeyError`` naming the file and the key path otherwise), and where the
    template holds an array the saved one must have its shape and dtype (``ValueError``) and
    comes back on the template array's device (or ``device``). The template is not modified.

    Args:
        path: a file :func:`save` wrote.
        device: where to place every array (a device or its name); ``None`` keeps each one's.
        template: optional, the structure to load into (see above).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not a safetensors file, is truncated or damaged, an array does
            not match the template, or a saved device does not exist here (the message names
            ``path``).
        KeyError: a key path of the template is not in the file, or the other way round.

    Example:
        >>> import os, tempfile, numpy as np, cupy_parallel as cp
        >>> cp.set_host_device_count(2)
        >>> path = os.path.join(tempfile.mkdtemp(), "state.safetensors")
        >>> cp.save([cp.to_device(np.ones(2, np.float32), "host:1"), 2.5], path)
        >>> cp.load(path)
        [HostArray([1., 1.], dtype=float32, device='host:1'), 2.5]
        >>> cp.load(path, device="cpu")[0]
        array([1., 1.], dtype=float32)
    """
    path = os.fsdecode(path)
    target = None if device is None else as_device(device)
    file, handle = _open_once(path)
    with handle:
        direct = _Direct(file)
        try:
            return _load(path, handle, direct, target, template)
        finally:
            direct.close()


def _open_once(path: str) -> tuple[Any, Any]:
    """``path`` opened as a file and by ``safe_open``, both on one version of the file.

    A save replaces the file by a rename at any moment; the two opens must not straddle one,
    or the description of one version would be read with the tensors of the next (a step
    count of one save with the parameters of another). The file is opened first, and kept
    only if ``path`` still names it after ``safe_open`` (which opened it in between) did.
    """
    for _attempt in range(20):
        try:
            file = open(path, "rb")  # noqa: SIM115 - closed by _Direct.close or below
        except FileNotFoundError:
            raise FileNotFoundError(f"no checkpoint at {path}.") from None
        except OSError:
            _open(path).__exit__(None, None, None)  # a directory: "not a checkpoint"
            raise
        try:
            handle = _open(path)
        except BaseException:
            file.close()
            raise
        with contextlib.suppress(OSError):
            opened, now = os.fstat(file.fileno()), os.stat(path)
            if (opened.st_dev, opened.st_ino) == (now.st_dev, now.st_ino):
                return file, handle
        file.close()
        handle.__exit__(None, None, None)
    raise RuntimeError(f"{path} was replaced 20 times while load opened it; try again.")


def _load(path: str, handle: Any, direct: _Direct, target: Device | None, template: Any) -> Any:
    description = _description(path, handle)
    if description is None:  # another tool's safetensors file
        if template is not None:
            raise ValueError(f"{path} is a plain safetensors file, not a saved tree.")
        reader = _Reader(path, handle, [], target, direct)
        return {
            name: reader.place(reader.tensor(name, name), target or CPU, name)
            for name in handle.keys()  # noqa: SIM118 - safe_open is not iterable
        }
    leaves, paths = description.get("leaves"), description.get("paths")
    if not (isinstance(leaves, list) and isinstance(paths, list) and len(leaves) == len(paths)):
        raise _damaged(path, "its leaf records are missing")
    if not all(type(key) is str for key in paths):
        raise _damaged(path, "its key paths are not strings")
    reader = _Reader(path, handle, leaves, target, direct)
    if template is None:
        try:
            return reader.node(description.get("tree"), "tree")
        except RecursionError:
            raise _damaged(path, "its tree is nested beyond Python's recursion limit") from None
    return _into(reader, paths, template)


def _into(reader: _Reader, paths: list[str], template: Any) -> Any:
    accessors, likes, spec = _tree.flatten(template)
    saved = {path: index for index, path in enumerate(paths)}
    wanted = [_tree.key_path(accessor, "") for accessor in accessors]
    missing = [key for key in wanted if key not in saved]
    if missing:
        raise KeyError(f"{reader.path} has no tree{missing[0]} (a key path of the template).")
    extra = [key for key in paths if key not in set(wanted)]
    if extra:
        raise KeyError(f"{reader.path} holds tree{extra[0]}, which the template does not have.")
    values = []
    for key, like in zip(wanted, likes, strict=True):
        index, where = saved[key], f"tree{key}"
        record = reader.leaves[index]
        if is_array(like):
            if not (isinstance(record, dict) and "array" in record and record.get("device")):
                raise ValueError(f"{reader.path}: {where} is not an array in the file.")
            if not _is_array_record(record):
                raise _damaged(reader.path, f"the array record of {where} is malformed")
            try:
                dtype = dtype_of_name(record["dtype"])
            except (TypeError, ValueError) as error:
                raise _damaged(reader.path, f"the dtype of {where}: {error}") from None
            if tuple(record["shape"]) != like.shape or dtype != like.dtype:
                raise ValueError(
                    f"{reader.path}: {where} was saved with shape {tuple(record['shape'])} and "
                    f"dtype {dtype}; the template has shape {like.shape} and dtype {like.dtype}."
                )
            values.append(reader.leaf(index, where, reader.device or device_of(like)))
        else:
            values.append(reader.leaf(index, where))
    return optree.tree_unflatten(spec, values)
