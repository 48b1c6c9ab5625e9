"""Pytrees: flatten nested containers of arrays to named leaves, record the structure as JSON,
and rebuild it.

Containers handled without any framework: ``dict`` (insertion order kept; ``str`` or ``int``
keys), ``list``, ``tuple``, named tuples and ``None``. Python scalars and strings are stored
in the structure itself and come back as they were. Any other node registered with JAX
(flax structs, equinox modules, custom classes) is flattened through ``jax.tree_util`` when
JAX is already imported; it comes back as a ``dict`` of its children unless the caller
passes ``structure=`` (an example tree, as orbax's restore target).

Leaf names join the path with ``"."``: ``{"params": {"w": x}}`` gives ``"params.w"``, list and
tuple items their index, named-tuple and JAX attribute children their field name.

No class named by a file is ever imported: a named tuple is rebuilt with its class only if
that class's module is already in ``sys.modules``, else as an equivalent
``collections.namedtuple``.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any

from ..errors import ArrayioError, FormatError, UnsupportedObjectError
from ._frameworks import is_array

__all__ = [
    "SINGLE_ARRAY_KEY",
    "example_keys",
    "flatten",
    "leaves_by_key",
    "rebuild_like",
    "unflatten",
]

# The key a lone array (not in any container) is stored under.
SINGLE_ARRAY_KEY = "array"
_SEPARATOR = "."

Node = dict[str, Any]


def _join(prefix: str, name: object) -> str:
    return f"{prefix}{_SEPARATOR}{name}" if prefix else str(name)


def _constant(x: Any) -> Node | None:
    if x is None:
        return {"none": None}
    if isinstance(x, bool):
        return {"bool": x}
    if isinstance(x, int):
        return {"int": str(x)}
    if isinstance(x, float):
        return {"float": repr(x)}
    if isinstance(x, complex):
        return {"complex": [repr(x.real), repr(x.imag)]}
    if isinstance(x, str):
        return {"str": x}
    return None


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _jax_children(x: Any) -> list[tuple[str, Any]] | None:
    """Children of a JAX-registered node, one level down, or None if JAX sees a leaf."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    pairs, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    if len(pairs) == 1 and pairs[0][0] == () and pairs[0][1] is x:
        return None
    return [(_key_entry_name(path[0]), child) for path, child in pairs]


def _key_entry_name(entry: Any) -> str:
    for attribute in ("key", "idx", "name"):
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)


def flatten(obj: Any) -> tuple[list[tuple[str, Any]], Node]:
    """Flatten ``obj`` into ``[(key, array), ...]`` and a JSON-able structure.

    Raises
    ------
    UnsupportedObjectError
        For leaves that are neither arrays nor constants, unsupported dict keys, or two
        leaves whose names collide.
    """
    leaves: list[tuple[str, Any]] = []
    seen: set[str] = set()

    def claim(key: str) -> str:
        # Constants count too: a structure= load finds every leaf by its key.
        if key in seen:
            raise UnsupportedObjectError(
                f"two leaves would both be stored under the key {key!r}; rename one "
                f"(keys join the path with {_SEPARATOR!r})"
            )
        if key == "__metadata__":
            raise UnsupportedObjectError("'__metadata__' is reserved by the file format")
        seen.add(key)
        return key

    def visit(x: Any, key: str) -> Node:
        if is_array(x):
            key = claim(key or SINGLE_ARRAY_KEY)
            leaves.append((key, x))
            return {"leaf": key}
        constant = _constant(x)
        if constant is not None:
            claim(key or SINGLE_ARRAY_KEY)
            return constant
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if not isinstance(k, str | int) or isinstance(k, bool):
                    raise UnsupportedObjectError(
                        f"dict keys must be str or int, got {k!r} at {key or 'the root'!r}"
                    )
                items.append([k, visit(v, _join(key, k))])
            return {"dict": items}
        if _is_namedtuple(x):
            fields = list(type(x)._fields)
            return {
                "namedtuple": _class_path(type(x)),
                "fields": fields,
                "children": [visit(v, _join(key, f)) for f, v in zip(fields, x, strict=True)],
            }
        if isinstance(x, list | tuple):
            kind = "list" if isinstance(x, list) else "tuple"
            return {kind: [visit(v, _join(key, i)) for i, v in enumerate(x)]}
        children = _jax_children(x)
        if children is None:
            raise UnsupportedObjectError(
                f"cannot save {type(x).__name__} at {key or 'the root'!r}: not an array, a "
                "dict/list/tuple, a Python scalar or a registered JAX pytree node"
            )
        return {
            "custom": _class_path(type(x)),
            "children": [[name, visit(child, _join(key, name))] for name, child in children],
        }

    return leaves, visit(obj, "")


def _namedtuple_class(path: str, fields: list[str]) -> type:
    module_name, _, qualname = path.partition(":")
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if (
        isinstance(found, type)
        and issubclass(found, tuple)
        and list(getattr(found, "_fields", ())) == fields
    ):
        return found
    name = qualname.rpartition(".")[2]
    return collections.namedtuple(name if name.isidentifier() else "Record", fields)


def unflatten(tree: Node, leaf: Callable[[str], Any], *, where: str = "") -> Any:
    """Rebuild a structure recorded by :func:`flatten`, asking ``leaf(key)`` for each array.

    Raises
    ------
    FormatError
        For a structure that is not one :func:`flatten` writes (``where`` names the file).
    """
    try:
        return _unflatten(tree, leaf)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as error:
        if isinstance(error, ArrayioError):  # raised reading a leaf: not a structure problem
            raise
        raise FormatError(
            f"{where}malformed pytree structure in arrayio metadata: {error!r}"
        ) from None


def validate(tree: Node, *, where: str = "") -> list[str]:
    """Check a stored structure completely and return its array keys, in order.

    Raises
    ------
    FormatError
        For anything :func:`unflatten` would trip on later.
    """
    keys: list[str] = []

    def collect(key: Any) -> None:
        if not isinstance(key, str):
            raise ValueError(f"leaf key {key!r} is not a string")
        keys.append(key)

    unflatten(tree, collect, where=where)
    return keys


def _unflatten(node: Node, leaf: Callable[[str], Any]) -> Any:
    if not isinstance(node, dict) or len(node) == 0:
        raise ValueError(f"bad node {node!r}")
    if "leaf" in node:
        return leaf(node["leaf"])
    if "none" in node:
        return None
    if "bool" in node:
        return bool(node["bool"])
    if "int" in node:
        return int(node["int"])
    if "float" in node:
        return float(node["float"])
    if "complex" in node:
        real, imag = node["complex"]
        return complex(float(real), float(imag))
    if "str" in node:
        return str(node["str"])
    if "dict" in node:
        return {k: _unflatten(child, leaf) for k, child in node["dict"]}
    if "list" in node:
        return [_unflatten(child, leaf) for child in node["list"]]
    if "tuple" in node:
        return tuple(_unflatten(child, leaf) for child in node["tuple"])
    if "namedtuple" in node:
        cls = _namedtuple_class(node["namedtuple"], list(node["fields"]))
        return cls(*(_unflatten(child, leaf) for child in node["children"]))
    if "custom" in node:
        return {name: _unflatten(child, leaf) for name, child in node["children"]}
    raise ValueError(f"unknown node kind {sorted(node)}")


def leaves_by_key(obj: Any) -> dict[str, Any]:
    """Map each leaf of a loaded tree (arrays and constants) to its key, as :func:`flatten`
    names them."""
    found: dict[str, Any] = {}

    def visit(x: Any, key: str) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                visit(v, _join(key, k))
        elif _is_namedtuple(x):
            for f, v in zip(x._fields, x, strict=True):
                visit(v, _join(key, f))
        elif isinstance(x, list | tuple):
            for i, v in enumerate(x):
                visit(v, _join(key, i))
        else:
            found[key or SINGLE_ARRAY_KEY] = x

    visit(obj, "")
    return found


def rebuild_like(structure: Any, lookup: Callable[[str], Any]) -> Any:
    """Rebuild ``structure`` (an example tree) with each leaf replaced by ``lookup(key)``.

    The example's leaves may be arrays, ``jax.ShapeDtypeStruct`` placeholders or constants;
    only its shape as a tree matters. Custom JAX nodes are rebuilt with JAX's own unflatten.
    """
    return _walk_example(structure, "", lambda key, _: lookup(key), rebuild=True)


def example_keys(structure: Any) -> list[str]:
    """The keys :func:`rebuild_like` asks ``lookup`` for, in order, without rebuilding."""
    keys: list[str] = []
    _walk_example(structure, "", lambda key, _: keys.append(key), rebuild=False)
    return keys


def example_leaves(structure: Any) -> dict[str, Any]:
    r"""The example's leaves (arrays, ``jax.ShapeDtypeStruct``\ s, constants) by the keys
    :func:`rebuild_like` asks for."""
    leaves: dict[str, Any] = {}
    _walk_example(structure, "", leaves.__setitem__, rebuild=False)
    return leaves


def _walk_example(x: Any, key: str, leaf: Callable[[str, Any], Any], *, rebuild: bool) -> Any:
    def visit(x: Any, key: str) -> Any:
        return _walk_example(x, key, leaf, rebuild=rebuild)

    if isinstance(x, dict):
        items = [(k, visit(v, _join(key, k))) for k, v in x.items()]
        return type(x)(items) if rebuild else None
    if _is_namedtuple(x):
        values = [visit(v, _join(key, f)) for f, v in zip(x._fields, x, strict=True)]
        return type(x)(*values) if rebuild else None
    if isinstance(x, list | tuple):
        values = [visit(v, _join(key, i)) for i, v in enumerate(x)]
        return type(x)(values) if rebuild else None
    if x is None:
        return None
    children = None if is_array(x) or _constant(x) is not None else _jax_children(x)
    if children is None:
        return leaf(key or SINGLE_ARRAY_KEY, x)
    values = [visit(child, _join(key, name)) for name, child in children]
    if not rebuild:
        return None
    jax = sys.modules["jax"]
    _, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
    return jax.tree_util.tree_unflatten(treedef, values)
