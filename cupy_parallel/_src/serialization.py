"""``save`` and ``load``: a pytree of arrays and scalars in one safetensors file, atomically.

The format is `safetensors <https://huggingface.co/docs/safetensors>`_ (a dependency of the
package for this): an 8-byte header length, a JSON header naming each tensor's dtype, shape and
byte range, then the raw bytes. It was chosen over ``pickle`` (``numpy.savez`` of objects,
``torch.save``) because reading it never runs code, over a home-made layout because other tools
(``safetensors`` itself, Hugging Face's loaders, Rust and C++ readers) read it, and because its
writer takes the arrays' memory as it is (no copy of 1 GiB to write 1 GiB) and its reader makes
one fresh array per tensor. What safetensors cannot say itself travels in its string metadata,
as JSON under the key ``"cupy_parallel"``: the tree's structure, the Python scalars and strings
in it, each array's device and true dtype.

- **Tensors** are named by their key path (``"layer.0.w"``) so that other tools see readable
  names; arrays of a dtype safetensors lacks (``complex128``, ``longdouble``, datetimes, fixed
  strings, big-endian dtypes, ``ml_dtypes`` types such as bfloat16) are stored as their bytes
  (``uint8`` with a last axis of the item size, so that rows still slice) and their true dtype is
  in the metadata. Object, structured and ``StringDType`` arrays hold references, not values:
  ``TypeError``.
- **Scalars**: ``bool``, ``int`` (any size), ``float`` (bit-exact: ``float.hex``), ``complex``,
  ``str``, ``bytes`` and ``None``; NumPy scalars come back as NumPy scalars of their dtype.
  Anything else is a ``TypeError`` naming its key path: there is no pickle, so loading a file can
  never run code.
- **Containers**: dict, ``OrderedDict``, list, tuple and namedtuples come back as such (dicts in
  their order; a namedtuple as a namedtuple of the same name and fields, made afresh since a file
  must not name code to import). Other nodes (registered classes, ``defaultdict``, ``deque``) are
  saved with their contents and load only into a ``template`` that has them.
- **Atomic**: the file is written under a temporary name in the target's directory, flushed to
  disk (``fsync``), renamed over the target (``os.replace``) and the directory is synced, so that
  a save killed at any moment leaves either the previous file or the new one at ``path``, each
  whole. A killed save can leave its temporary file (``.<name>.<random>.tmp``) behind.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import secrets
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
    "decode_array",
    "dtype_name",
    "dtype_of_name",
    "encode_array",
    "fsync_directory",
    "load",
    "read_scalar",
    "replace_atomically",
    "save",
    "scalar_record",
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


def _dtype_tag(dtype: np.dtype[Any], where: str) -> str | None:
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
        return np.dtype(kind)
    try:
        dtype = np.dtype(tag)
    except TypeError:
        raise ValueError(f"the file names an unknown dtype {tag!r}.") from None
    if dtype.hasobject or dtype.fields is not None or dtype.kind == "T" or not dtype.itemsize:
        raise ValueError(f"the file names dtype {tag!r}, which does not hold values.")
    return dtype


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
    tag = _dtype_tag(np.dtype(array.dtype), where)
    if type(array) is HostArray:
        host = plain_buffer(array)
    elif isinstance(array, np.ndarray):
        host = array
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


def write_safetensors(
    path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None
) -> None:
    """Write ``tensors`` (C-contiguous) as a safetensors file at ``path``, flushed to disk.

    The file is the format's documented layout (safetensors' own reader reads it; the tests
    check so): the header, then each array's bytes written from its memory as it is.
    ``safetensors.serialize_file`` writes the same file but took 3.5x the time of a plain
    ``write`` of 1 GiB here, which the 1.2x target of ``numpy.save`` does not leave room for.
    """
    with open(path, "wb") as out:
        out.write(_header(tensors, metadata))
        for array in tensors.values():
            if array.nbytes:
                out.write(array.reshape(-1).view(np.uint8).data)
        out.flush()
        os.fsync(out.fileno())


def replace_atomically(path: str, write: Any) -> None:
    """Call ``write(temporary_path)``, then rename that file over ``path`` and sync the directory.

    The temporary file sits in ``path``'s directory (a rename is atomic within one file system)
    and is created with the permissions a new file gets (``0o666`` less the umask); it is
    removed if ``write`` raises.
    """
    directory, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
    os.close(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        write(temporary)
        os.replace(temporary, path)
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


def scalar_record(value: Any) -> dict[str, Any]:
    kind = type(value)
    if kind is bool:
        return {"bool": value}
    if kind is int:
        return {"int": str(value)}
    if kind is float:
        return {"float": value.hex()}
    if kind is complex:
        return {"complex": [value.real.hex(), value.imag.hex()]}
    if kind is str:
        return {"str": value}
    return {"bytes": value.hex()}


def read_scalar(record: Any) -> tuple[bool, Any]:
    """``(True, value)`` for a scalar record, ``(False, None)`` otherwise."""
    if not isinstance(record, dict) or len(record) != 1:
        return False, None
    ((kind, value),) = record.items()
    if kind == "bool":
        return True, bool(value)
    if kind == "int":
        return True, int(value)
    if kind == "float":
        return True, float.fromhex(value)
    if kind == "complex":
        return True, complex(float.fromhex(value[0]), float.fromhex(value[1]))
    if kind == "str":
        return True, str(value)
    if kind == "bytes":
        return True, bytes.fromhex(value)
    if kind == "none":
        return True, None
    return False, None


class _Encoder:
    """The tree's structure and scalars as JSON records, its arrays as named tensors."""

    def __init__(self) -> None:
        self.tensors: dict[str, np.ndarray] = {}

    def _tensor_name(self, accessor: PyTreeAccessor) -> str:
        name = ".".join(str(entry.entry) for entry in accessor) or "tensor"
        if name in self.tensors or name.startswith("__"):  # "__metadata__" is safetensors'
            name = f"{name}#{len(self.tensors)}"
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
    path = os.fspath(path)
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
    metadata = {METADATA_KEY: json.dumps(description, separators=(",", ":"))}
    replace_atomically(path, lambda temp: write_safetensors(temp, encoder.tensors, metadata))


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

    def __init__(self, path: str) -> None:
        self.file = open(path, "rb")  # noqa: SIM115 - closed by close()
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
        name, device_name = record.get("array"), record.get("device")
        if not isinstance(name, str) or not isinstance(device_name, str | None):
            raise _damaged(self.path, f"the record of {where} is not an array's")
        stored = self.tensor(name, where)
        try:
            dtype = dtype_of_name(record.get("dtype"))
            array = decode_array(stored, record["dtype"] if record.get("raw") else None)
        except ValueError as error:
            raise _damaged(self.path, f"tensor {name!r} ({where}): {error}") from None
        if list(array.shape) != record.get("shape") or array.dtype != dtype:
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
            values = [self.node(child, f"{where}[{i}]") for i, child in enumerate(body)]
            return values if kind == "list" else tuple(values)
        if kind == "namedtuple":
            name, fields, children = body
            cls = _namedtuple(name, tuple(fields))
            pairs = zip(fields, children, strict=True)
            return cls(*(self.node(child, f"{where}.{field}") for field, child in pairs))
        if kind == "node":
            raise ValueError(
                f"{self.path}: {where} is a {body[0]}, which load cannot rebuild without running "
                "code; pass template= (a tree of that structure) to load into its classes."
            )
        raise _damaged(self.path, f"the record at {where} is of unknown kind {kind!r}")


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
    except ValueError:
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
    path = os.fspath(path)
    target = None if device is None else as_device(device)
    with _open(path) as handle:
        direct = _Direct(path)
        try:
            return _load(path, handle, direct, target, template)
        finally:
            direct.close()


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
    if not isinstance(leaves, list) or not isinstance(paths, list) or len(leaves) != len(paths):
        raise _damaged(path, "its leaf records are missing")
    reader = _Reader(path, handle, leaves, target, direct)
    if template is None:
        return reader.node(description.get("tree"), "tree")
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
            if not (isinstance(record, dict) and "array" in record and record["device"]):
                raise ValueError(f"{reader.path}: {where} is not an array in the file.")
            dtype = dtype_of_name(record["dtype"])
            if tuple(record["shape"]) != like.shape or dtype != like.dtype:
                raise ValueError(
                    f"{reader.path}: {where} was saved with shape {tuple(record['shape'])} and "
                    f"dtype {dtype}; the template has shape {like.shape} and dtype {like.dtype}."
                )
            values.append(reader.leaf(index, where, reader.device or device_of(like)))
        else:
            values.append(reader.leaf(index, where))
    return optree.tree_unflatten(spec, values)
