"""A JSON Schema as the graph llguidance compiles: subschemas by JSON pointer, ``$ref`` edges.

Pure Python, no recursion (a schema is hostile input). Every subschema is
indexed by its JSON pointer, with the resource it belongs to (its nearest
``$id``) and the ``$anchor`` names it declares, so a ``$ref`` resolves as
llguidance resolves it within the document: ``#``, JSON pointers
(``#/$defs/a~1b``, percent-encoded), ``$id`` URIs and anchors. A reference
outside the document is refused: llguidance has nothing to fetch it with.

The graph's nodes are the subschemas reachable from the root through what
llguidance compiles (``properties``, ``items``, ``anyOf``, ... and ``$ref``);
:meth:`SchemaGraph.components` groups them into strongly connected
components (recursive definitions), each listed after the ones it reaches.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urljoin

TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
# Keywords whose values are subschemas llguidance compiles: one, a list, a map.
_ONE = ("additionalProperties", "additionalItems", "items")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties")
# Keywords that hold subschemas llguidance does not compile (indexed for
# $id / $anchor and as $ref targets, never followed on their own).
_HELD_ONE = ("not", "if", "then", "else", "contains", "propertyNames", "unevaluatedProperties")
_HELD_MAP = ("$defs", "definitions", "dependentSchemas")
_ROOT_URI = "json-schema:///"
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


class InvalidSchema(ValueError):
    """The schema is malformed, or a ``$ref`` names nothing in it."""


@dataclass
class Node:
    """One subschema llguidance compiles: its pointer, value, children and ``$ref`` target."""

    pointer: str
    value: Any
    children: list[str] = field(default_factory=list)
    ref: str | None = None

    @property
    def edges(self) -> list[str]:
        return [*self.children, self.ref] if self.ref is not None else self.children


def escape(key: str) -> str:
    """A key as a JSON pointer segment."""
    return key.replace("~", "~0").replace("/", "~1")


def subschemas(pointer: str, value: dict[str, Any], *, held: bool) -> Iterator[tuple[str, Any]]:
    """``(pointer, subschema)`` for each subschema position under ``value``.

    ``held`` also yields the positions llguidance does not compile
    (``$defs``, ``not``, ...).
    """
    for key in _ONE + (_HELD_ONE if held else ()):
        sub = value.get(key)
        if isinstance(sub, (dict, bool)):
            yield f"{pointer}/{escape(key)}", sub
    for key in _LIST:
        subs = value.get(key)
        if isinstance(subs, list):
            for i, sub in enumerate(subs):
                yield f"{pointer}/{key}/{i}", sub
    for key in _MAP + (_HELD_MAP if held else ()):
        subs = value.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                yield f"{pointer}/{escape(key)}/{escape(name)}", sub


def _join(base: str, ref: str) -> str:
    """``ref`` resolved against ``base`` (enough of RFC 3986 for schema ids)."""
    if ref.startswith("#"):
        return base.split("#", 1)[0] + ref
    if _SCHEME.match(ref):
        return ref
    return urljoin(base, ref)


class SchemaGraph:
    """``schema`` indexed, and the part llguidance compiles as :attr:`nodes`.

    Raises :class:`InvalidSchema` for a subschema that is neither an object
    nor a boolean, and for a ``$ref`` that names nothing in the document.
    """

    def __init__(self, schema: Any):
        self.values: dict[str, Any] = {}
        self.properties = 0  # in every object of the document
        self._bases: dict[str, str] = {}
        self._resources: dict[str, str] = {_ROOT_URI: ""}
        self._anchors: dict[str, str] = {}
        self._index(schema)
        self.nodes = self._reachable()

    def _index(self, schema: Any) -> None:
        stack: list[tuple[str, Any, str]] = [("", schema, _ROOT_URI)]
        while stack:
            pointer, value, base = stack.pop()
            if not isinstance(value, (dict, bool)):
                raise InvalidSchema(
                    f"the subschema at '#{pointer}' is a {type(value).__name__}; "
                    "a schema is an object or a boolean"
                )
            self.values[pointer] = value
            if isinstance(value, dict):
                ident = value.get("$id")
                if isinstance(ident, str) and ident:
                    base = _join(base, ident).split("#", 1)[0]
                    self._resources[base] = pointer
                anchor = value.get("$anchor")
                if isinstance(anchor, str):
                    self._anchors[f"{base}#{anchor}"] = pointer
                props = value.get("properties")
                if isinstance(props, dict):
                    self.properties += len(props)
                stack.extend((p, sub, base) for p, sub in subschemas(pointer, value, held=True))
            self._bases[pointer] = base

    def resolve(self, pointer: str, ref: Any) -> str:
        """The pointer of the subschema the ``$ref`` at ``pointer`` names."""
        if not isinstance(ref, str):
            raise InvalidSchema(f"'$ref' at '#{pointer}' is not a string")
        uri, _, fragment = _join(self._bases[pointer], ref).partition("#")
        root = self._resources.get(uri)
        if root is None:
            raise InvalidSchema(
                f"'$ref' {ref[:200]!r} (at '#{pointer}') points outside the schema; only "
                "references within it ('#', '#/$defs/...', an '$id' or an '$anchor' it "
                "declares) are resolved"
            )
        if fragment and not fragment.startswith("/"):
            target = self._anchors.get(f"{uri}#{fragment}")
        else:
            target = root + unquote(fragment)
        if target is None or target not in self.values:
            raise InvalidSchema(
                f"'$ref' {ref[:200]!r} (at '#{pointer}') names no subschema of this schema"
            )
        return target

    def _reachable(self) -> dict[str, Node]:
        nodes: dict[str, Node] = {}
        todo = [""]
        while todo:
            pointer = todo.pop()
            if pointer in nodes:
                continue
            value = self.values[pointer]
            node = nodes[pointer] = Node(pointer, value)
            if isinstance(value, bool):
                continue
            node.children = [p for p, _ in subschemas(pointer, value, held=False)]
            if "$ref" in value:
                node.ref = self.resolve(pointer, value["$ref"])
            todo.extend(node.edges)
        return nodes

    def components(self) -> list[list[str]]:
        """Tarjan's strongly connected components, iteratively; each after those it reaches."""
        nodes = self.nodes
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        on_stack: set[str] = set()
        stack: list[str] = []
        out: list[list[str]] = []
        for start in nodes:
            if start in index:
                continue
            index[start] = low[start] = len(index)
            stack.append(start)
            on_stack.add(start)
            work = [(start, iter(nodes[start].edges))]
            while work:
                v, edges = work[-1]
                for w in edges:
                    if w not in index:
                        index[w] = low[w] = len(index)
                        stack.append(w)
                        on_stack.add(w)
                        work.append((w, iter(nodes[w].edges)))
                        break
                    if w in on_stack:
                        low[v] = min(low[v], index[w])
                else:
                    work.pop()
                    if work:
                        parent = work[-1][0]
                        low[parent] = min(low[parent], low[v])
                    if low[v] == index[v]:
                        component = []
                        while True:
                            w = stack.pop()
                            on_stack.discard(w)
                            component.append(w)
                            if w == v:
                                break
                        out.append(component)
        return out

    def cyclic(self, component: list[str]) -> bool:
        """Whether a component is a cycle (several members, or one that refers to itself)."""
        return len(component) > 1 or component[0] in self.nodes[component[0]].edges
