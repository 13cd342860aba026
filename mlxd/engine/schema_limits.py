"""Bounds on a JSON Schema before llguidance sees it, and schemas that can never end.

llguidance compiles a schema by recursion (a ``$ref`` chain of 3,000 links
overflows an 8 MiB stack and kills the process), spends time that grows
faster than the schema (10,000 optional properties: seconds), and finds some
limits only while it generates: more than 2,000 Earley items in one row (a
position where an object's optional properties or an ``anyOf``'s branches
are all open), or lexer fuel spent on a counted repetition
(``(x{1000}){1000}``). :func:`check_schema` measures what drives each of
these in one linear walk, in pure Python, and refuses a schema beyond
:data:`LIMITS` with a 400 that names the limit (docs/api.md, "Structured
output limits"). It also refuses a ``$ref`` cycle with no way out (``{"$ref":
"#"}``, ``a -> b -> a``, a required property that is the object again):
llguidance compiles it, and generation then stalls on an empty mask.

The measures (each with the reason for its bound):

- ``depth``: the deepest recursion compiling can reach, counting a
  subschema's nesting and each ``$ref`` followed; a ``$ref`` target is
  compiled once, so a path through a recursive group counts each member
  once. About 4 KiB of stack a level: 256 levels stay under 1.1 MiB.
- ``width``: the alternatives open at one position (an object's optional
  properties count 4 Earley items each, an ``anyOf``/``oneOf`` adds its
  branches' widths, an ``allOf`` multiplies them): llguidance's row limit
  is 2,000, and a row also holds the items around it.
- ``repeat``: the product of nested counted repetitions in one ``pattern``
  (``(x{10}){100}`` is 1,000): an unanchored one costs the lexer fuel per
  character; 2,000 exhausts it mid-string.
- counts and sizes that bound compile time: subschemas, properties, the
  branches of one ``anyOf``/``oneOf``/``allOf``, ``enum`` values, a
  pattern's length, the schema's JSON size.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mlxd.engine.messages import ErrorCode


class StructureError(ValueError):
    """A schema or tool definition that cannot be enforced; a 400."""

    def __init__(self, message: str, *, code: ErrorCode, param: str):
        super().__init__(message)
        self.code: ErrorCode = code
        self.param = param


@dataclass(frozen=True)
class SchemaLimits:
    """The most a schema may ask of llguidance (docs/api.md, "Structured output limits")."""

    nodes: int = 10_000
    depth: int = 256
    properties: int = 5_000
    branches: int = 500
    width: int = 1_500
    enum: int = 1_000
    pattern_chars: int = 1_000
    repeat: int = 1_000
    json_chars: int = 1_048_576


LIMITS = SchemaLimits()

TYPES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})
# Keywords whose values are subschemas llguidance compiles: one, a list, a map.
_ONE = ("additionalProperties", "additionalItems", "items")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAP = ("properties", "patternProperties")
# Keywords that hold subschemas llguidance does not compile (counted, and
# searched for $id / $anchor, never followed).
_HELD_ONE = ("not", "if", "then", "else", "contains", "propertyNames", "unevaluatedProperties")
_HELD_MAP = ("$defs", "definitions", "dependentSchemas")
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_ROOT_URI = "json-schema:///"


def _too_complex(what: str, limit: int, param: str) -> StructureError:
    return StructureError(
        f"The schema is too complex to enforce: {what}; at most {limit} "
        "(docs/api.md, 'Structured output limits').",
        code="schema_too_complex",
        param=param,
    )


def _invalid(what: str, param: str) -> StructureError:
    return StructureError(f"The schema is not valid: {what}.", code="invalid_schema", param=param)


def repeat_product(pattern: str) -> int:
    """The largest product of nested counted repetitions (``{n}``, ``{n,m}``) in a regex.

    ``a{3}`` is 3, ``(a{3}b){4}`` 12, ``[ab]{2}|c{5}`` 5; ``*``, ``+`` and
    ``?`` count 1. Escapes and character classes are atoms.
    """
    frames = [1]  # the largest product seen inside each open group
    last = 1  # the product of the atom just read
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            if i <= n and pattern[i - 1] in "pPx" and i < n and pattern[i] == "{":
                close = pattern.find("}", i)
                i = n if close < 0 else close + 1
            last = 1
        elif c == "[":
            i = _class_end(pattern, i)
            last = 1
        elif c == "(":
            frames.append(1)
            i += 1
            last = 1
            continue
        elif c == ")":
            last = frames.pop() if len(frames) > 1 else 1
            i += 1
        elif c == "{" and (m := _REPEAT.match(pattern, i)):
            low, high = int(m.group(1)), m.group(2)
            count = max(low, int(high)) if high else low
            last *= max(count, 1)
            i = m.end()
        else:
            last = 1
            i += 1
        frames[-1] = max(frames[-1], last)
    return max(frames)


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class that opens at ``pattern[i]``."""
    i += 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    depth = 1
    while i < len(pattern) and depth:
        c = pattern[i]
        if c == "\\":
            i += 1
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        i += 1
    return i


@dataclass
class _Node:
    """One subschema position llguidance may compile."""

    pointer: str
    value: Any
    base: str  # the URI of the resource it belongs to (its nearest $id)
    children: list[str]
    ref: str | None = None  # the pointer of its $ref target


class _Walk:
    """The schema indexed by JSON pointer, with its resources and anchors."""

    def __init__(self, schema: Any, param: str, limits: SchemaLimits):
        self.param = param
        self.limits = limits
        self.values: dict[str, Any] = {}
        self.bases: dict[str, str] = {}
        self.resources: dict[str, str] = {_ROOT_URI: ""}
        self.anchors: dict[str, str] = {}
        self.properties = 0
        self._index(schema)

    def _index(self, schema: Any) -> None:
        stack: list[tuple[str, Any, str]] = [("", schema, _ROOT_URI)]
        while stack:
            pointer, value, base = stack.pop()
            if len(self.values) >= self.limits.nodes:
                limit = self.limits.nodes
                raise _too_complex(f"it has more than {limit} subschemas", limit, self.param)
            if not isinstance(value, (dict, bool)):
                raise _invalid(
                    f"the subschema at '#{pointer}' is a {type(value).__name__}; "
                    "a schema is an object or a boolean",
                    self.param,
                )
            self.values[pointer] = value
            if isinstance(value, bool):
                self.bases[pointer] = base
                continue
            ident = value.get("$id")
            if isinstance(ident, str) and ident:
                base = _join(base, ident).split("#", 1)[0]
                self.resources[base] = pointer
            anchor = value.get("$anchor")
            if isinstance(anchor, str):
                self.anchors[f"{base}#{anchor}"] = pointer
            self.bases[pointer] = base
            props = value.get("properties")
            if isinstance(props, dict):
                self.properties += len(props)
                if self.properties > self.limits.properties:
                    raise _too_complex(
                        f"it has more than {self.limits.properties} properties",
                        self.limits.properties,
                        self.param,
                    )
            for child, sub in _subschemas(pointer, value, held=True):
                stack.append((child, sub, base))

    def resolve(self, pointer: str, ref: Any) -> str:
        """The pointer a ``$ref`` at ``pointer`` names; a 400 when it names none here."""
        if not isinstance(ref, str):
            raise _invalid(f"'$ref' at '#{pointer}' is not a string", self.param)
        uri, _, fragment = _join(self.bases[pointer], ref).partition("#")
        root = self.resources.get(uri)
        if root is None:
            raise StructureError(
                f"The schema's '$ref' {ref[:200]!r} (at '#{pointer}') points outside the "
                "schema; only references within it ('#', '#/$defs/...', an '$id' or an "
                "'$anchor' it declares) are resolved.",
                code="invalid_schema",
                param=self.param,
            )
        if fragment and not fragment.startswith("/"):
            target = self.anchors.get(f"{uri}#{fragment}")
        else:
            target = root + _decode_pointer(fragment)
            if target not in self.values:
                target = None
        if target is None:
            raise _invalid(
                f"'$ref' {ref[:200]!r} (at '#{pointer}') names no subschema of this schema",
                self.param,
            )
        return target


def _join(base: str, ref: str) -> str:
    """``ref`` resolved against ``base`` (enough of RFC 3986 for schema ids)."""
    if ref.startswith("#"):
        return base.split("#", 1)[0] + ref
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", ref):
        return ref
    from urllib.parse import urljoin

    return urljoin(base, ref)


def _decode_pointer(fragment: str) -> str:
    from urllib.parse import unquote

    return unquote(fragment)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _subschemas(pointer: str, value: dict[str, Any], *, held: bool) -> Iterator[tuple[str, Any]]:
    """``(pointer, subschema)`` for each subschema position under ``value``.

    ``held`` also yields the positions llguidance does not compile
    (``$defs``, ``not``, ...), for indexing.
    """
    for key in _ONE + (_HELD_ONE if held else ()):
        sub = value.get(key)
        if isinstance(sub, (dict, bool)):
            yield f"{pointer}/{_escape(key)}", sub
    for key in _LIST:
        subs = value.get(key)
        if isinstance(subs, list):
            for i, sub in enumerate(subs):
                yield f"{pointer}/{key}/{i}", sub
    for key in _MAP + (_HELD_MAP if held else ()):
        subs = value.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                yield f"{pointer}/{_escape(key)}/{_escape(name)}", sub


def _graph(walk: _Walk) -> dict[str, _Node]:
    """The subschemas reachable from the root through what llguidance compiles."""
    nodes: dict[str, _Node] = {}
    todo = [""]
    while todo:
        pointer = todo.pop()
        if pointer in nodes:
            continue
        value = walk.values[pointer]
        node = _Node(pointer, value, walk.bases[pointer], [])
        nodes[pointer] = node
        if isinstance(value, bool):
            continue
        _check_values(walk, pointer, value)
        node.children = [child for child, _ in _subschemas(pointer, value, held=False)]
        if "$ref" in value:
            node.ref = walk.resolve(pointer, value["$ref"])
        todo.extend(node.children)
        if node.ref is not None:
            todo.append(node.ref)
    return nodes


def _check_values(walk: _Walk, pointer: str, value: dict[str, Any]) -> None:
    """The keywords of one subschema that are checked on their own."""
    limits, param = walk.limits, walk.param
    kind = value.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in TYPES:
            raise _invalid(
                f"'type' at '#{pointer}' is {str(k)[:50]!r}; use one of {', '.join(sorted(TYPES))}",
                param,
            )
    enum = value.get("enum")
    if isinstance(enum, list) and len(enum) > limits.enum:
        raise _too_complex(f"the enum at '#{pointer}' has {len(enum)} values", limits.enum, param)
    for key in ("anyOf", "oneOf", "allOf"):
        branches = value.get(key)
        if isinstance(branches, list) and len(branches) > limits.branches:
            raise _too_complex(
                f"the {key} at '#{pointer}' has {len(branches)} branches", limits.branches, param
            )
    patterns = [value.get("pattern")]
    if isinstance(value.get("patternProperties"), dict):
        patterns.extend(value["patternProperties"])
    for pattern in patterns:
        if not isinstance(pattern, str):
            continue
        if len(pattern) > limits.pattern_chars:
            raise _too_complex(
                f"a pattern at '#{pointer}' is {len(pattern)} characters long",
                limits.pattern_chars,
                param,
            )
        product = repeat_product(pattern)
        if product > limits.repeat:
            raise _too_complex(
                f"the pattern {pattern[:80]!r} at '#{pointer}' repeats {product} times "
                "(nested counted repetitions multiply)",
                limits.repeat,
                param,
            )


def _components(nodes: dict[str, _Node]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively; each comes after those it reaches."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(_edges(nodes[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            advanced = False
            for w in edges:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(_edges(nodes[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
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


def _edges(node: _Node) -> list[str]:
    return [*node.children, node.ref] if node.ref is not None else node.children


def _depth(nodes: dict[str, _Node], components: list[list[str]]) -> tuple[int, str]:
    """The deepest recursion (and where it starts): members of a cycle count once each."""
    member = {p: i for i, c in enumerate(components) for p in c}
    deepest: list[int] = []
    for i, component in enumerate(components):  # successors come first
        below = 0
        for p in component:
            for w in _edges(nodes[p]):
                j = member[w]
                if j != i:
                    below = max(below, deepest[j])
        deepest.append(len(component) + below)
    root = member[""]
    return deepest[root], ""


def _width(nodes: dict[str, _Node], components: list[list[str]], cap: int) -> dict[str, int]:
    """The alternatives open where each subschema starts, capped at ``cap`` + 1."""
    widths: dict[str, int] = {}
    for component in components:  # successors come first; a cycle counts once
        for p in component:
            widths[p] = 1
        for p in component:
            widths[p] = min(_own_width(nodes[p], widths), cap + 1)
    return widths


def _own_width(node: _Node, widths: dict[str, int]) -> int:
    value = node.value
    if isinstance(value, bool):
        return 1
    width = 1
    props = value.get("properties")
    if isinstance(props, dict) and props:
        required = value.get("required")
        needed = set(required) if isinstance(required, list) else set()
        optional = sum(1 for name in props if name not in needed)
        width = 4 * optional + 7 if optional else 1
    for key in ("anyOf", "oneOf"):
        branches = value.get(key)
        if isinstance(branches, list) and branches:
            width *= sum(widths.get(f"{node.pointer}/{key}/{i}", 1) for i in range(len(branches)))
    branches = value.get("allOf")
    if isinstance(branches, list):
        for i in range(len(branches)):
            width *= widths.get(f"{node.pointer}/allOf/{i}", 1)
    if node.ref is not None:
        width *= widths.get(node.ref, 1)
    return width


def _productive(nodes: dict[str, _Node], components: list[list[str]]) -> list[str]:
    """The subschemas on a ``$ref`` cycle that no finite value can satisfy."""
    done: dict[str, bool] = {}
    dead: list[str] = []
    for component in components:
        for p in component:
            done[p] = False
        changed = True
        while changed:
            changed = False
            for p in component:
                if not done[p] and _can_end(nodes[p], done):
                    done[p] = True
                    changed = True
        cyclic = len(component) > 1 or component[0] in _edges(nodes[component[0]])
        if cyclic:
            dead.extend(p for p in component if not done[p])
    return dead


def _can_end(node: _Node, done: dict[str, bool]) -> bool:
    """Whether some finite value satisfies ``node``, given what is known of the others."""
    value = node.value
    if isinstance(value, bool):
        return value
    p = node.pointer
    if node.ref is not None and not done.get(node.ref, True):
        return False
    every = value.get("allOf")
    if isinstance(every, list) and not all(
        done.get(f"{p}/allOf/{i}", True) for i in range(len(every))
    ):
        return False
    for key in ("anyOf", "oneOf"):
        branches = value.get(key)
        if (
            isinstance(branches, list)
            and branches
            and not any(done.get(f"{p}/{key}/{i}", True) for i in range(len(branches)))
        ):
            return False
    if "enum" in value or "const" in value:
        return True
    kind = value.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else list(TYPES)
    return any(_type_can_end(node, k, done) for k in kinds)


def _type_can_end(node: _Node, kind: str, done: dict[str, bool]) -> bool:
    value, p = node.value, node.pointer
    if kind == "object":
        required = value.get("required")
        props = value.get("properties") if isinstance(value.get("properties"), dict) else {}
        for name in required if isinstance(required, list) else []:
            if not isinstance(name, str):
                continue
            where = (
                f"{p}/properties/{_escape(name)}" if name in props else f"{p}/additionalProperties"
            )
            if not done.get(where, True):
                return False
        return True
    if kind == "array":
        least = value.get("minItems")
        least = least if isinstance(least, int) and least > 0 else 0
        prefix = value.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        for i in range(min(least, len(prefix))):
            if not done.get(f"{p}/prefixItems/{i}", True):
                return False
        items = value.get("items")
        if least > len(prefix) and isinstance(items, (dict, bool)):
            return done.get(f"{p}/items", True)
        return True
    return True


def check_schema(schema: Any, *, param: str, limits: SchemaLimits = LIMITS) -> None:
    """Refuse a schema beyond ``limits`` or with an endless ``$ref`` cycle (StructureError).

    Pure and linear in the schema's size; run before the schema reaches
    llguidance, whose compiler recurses without a bound on ``$ref`` chains.
    """
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise _invalid("a schema is an object or a boolean", param)
    size = len(json.dumps(schema, ensure_ascii=False))
    if size > limits.json_chars:
        raise _too_complex(f"it is {size} characters of JSON", limits.json_chars, param)
    walk = _Walk(schema, param, limits)
    nodes = _graph(walk)
    components = _components(nodes)
    depth, _ = _depth(nodes, components)
    if depth > limits.depth:
        raise _too_complex(
            f"compiling it nests {depth} levels deep (each subschema inside another, "
            "and each '$ref' followed, is a level)",
            limits.depth,
            param,
        )
    widths = _width(nodes, components, limits.width)
    widest = max(widths, key=lambda p: widths[p])
    if widths[widest] > limits.width:
        shown = f"more than {limits.width}" if widths[widest] > limits.width else widths[widest]
        raise _too_complex(
            f"at '#{widest}' {shown} alternatives are open at once (each optional property "
            "counts 4, the branches of an anyOf or oneOf add up, an allOf multiplies them)",
            limits.width,
            param,
        )
    dead = _productive(nodes, components)
    if dead:
        raise StructureError(
            f"The schema can never be satisfied: the subschema at '#{min(dead, key=len)}' "
            "refers back to itself through '$ref' with no way to end (every branch "
            "leads back into the cycle). Give the recursion a way out: an optional "
            "property, an anyOf branch without the '$ref', or an array that may be empty.",
            code="invalid_schema",
            param=param,
        )
