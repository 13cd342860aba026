"""Bounds on a JSON Schema before llguidance sees it, and schemas that can never end.

llguidance compiles a schema by recursion (a ``$ref`` chain of 3,000 links
overflows an 8 MiB stack and kills the process), spends time that grows
faster than the schema (10,000 optional properties: seconds), and finds some
limits only while it generates: more than 2,000 Earley items in one row (a
position where an object's optional properties or an ``anyOf``'s branches
are all open), or lexer fuel spent on a counted repetition
(``(x{1000}){1000}``). :func:`check_schema` measures what drives each of
these on the schema's graph (:mod:`mlxd.engine.schema_graph`), in linear
time and pure Python, and refuses a schema beyond
:data:`LIMITS` with a 400 that names the limit (docs/api.md, "Structured
output limits"). It also refuses a ``$ref`` cycle with no way out (``{"$ref":
"#"}``, ``a -> b -> a``, a required property that is the object again):
llguidance compiles it, and generation then stalls on an empty mask.

The measures (each with the reason for its bound):

- ``depth``: the deepest recursion compiling can reach, counting a
  subschema's nesting and each ``$ref`` followed; a ``$ref`` target is
  compiled once, so a path through a recursive group counts each member
  once. About 4 KiB of stack a level: 256 levels stay under 1.1 MiB.
  (llguidance's ``define_ref -> compile_resource`` recursion has no bound of
  its own: a report ready to file upstream is in
  docs/upstream/llguidance-ref-chain.md.)
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
from dataclasses import dataclass
from typing import Any

from mlxd.engine.messages import ErrorCode
from mlxd.engine.schema_graph import TYPES, InvalidSchema, Node, SchemaGraph, escape


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

_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")


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


def _check_values(pointer: str, value: dict[str, Any], limits: SchemaLimits, param: str) -> None:
    """The keywords of one subschema that are measured on their own."""
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


def _depth(graph: SchemaGraph, components: list[list[str]]) -> int:
    """The deepest recursion compiling can reach: members of a cycle count once each."""
    member = {p: i for i, c in enumerate(components) for p in c}
    deepest: list[int] = []
    for i, component in enumerate(components):  # what each reaches comes first
        below = 0
        for p in component:
            for w in graph.nodes[p].edges:
                if member[w] != i:
                    below = max(below, deepest[member[w]])
        deepest.append(len(component) + below)
    return deepest[member[""]]


def _widths(graph: SchemaGraph, components: list[list[str]], cap: int) -> dict[str, int]:
    """The alternatives open where each subschema starts, capped at ``cap`` + 1."""
    widths: dict[str, int] = {}
    for component in components:  # what each reaches comes first; a cycle counts once
        for p in component:
            widths[p] = 1
        for p in component:
            widths[p] = min(_width(graph.nodes[p], widths), cap + 1)
    return widths


def _width(node: Node, widths: dict[str, int]) -> int:
    value = node.value
    if isinstance(value, bool):
        return 1
    width = 1
    props = value.get("properties")
    if isinstance(props, dict) and props:
        required = value.get("required")
        needed = set(required) if isinstance(required, list) else set()
        optional = sum(1 for name in props if name not in needed)
        # llguidance: 4 Earley items per optional property, 7 for the object.
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


def _endless(graph: SchemaGraph, components: list[list[str]]) -> list[str]:
    """The subschemas on a ``$ref`` cycle that no finite value can satisfy."""
    ends: dict[str, bool] = {}
    endless: list[str] = []
    for component in components:  # what each reaches comes first: a fixpoint per cycle
        for p in component:
            ends[p] = False
        changed = True
        while changed:
            changed = False
            for p in component:
                if not ends[p] and _can_end(graph.nodes[p], ends):
                    ends[p] = changed = True
        if graph.cyclic(component):
            endless.extend(p for p in component if not ends[p])
    return endless


def _can_end(node: Node, ends: dict[str, bool]) -> bool:
    """Whether some finite value satisfies ``node``, given what is known of the others."""
    value, p = node.value, node.pointer
    if isinstance(value, bool):
        return value
    if node.ref is not None and not ends.get(node.ref, True):
        return False
    every = value.get("allOf")
    if isinstance(every, list) and not all(
        ends.get(f"{p}/allOf/{i}", True) for i in range(len(every))
    ):
        return False
    for key in ("anyOf", "oneOf"):
        branches = value.get(key)
        if (
            isinstance(branches, list)
            and branches
            and not any(ends.get(f"{p}/{key}/{i}", True) for i in range(len(branches)))
        ):
            return False
    if "enum" in value or "const" in value:
        return True
    kind = value.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if isinstance(kind, str) else list(TYPES)
    return any(_type_can_end(node, k, ends) for k in kinds)


def _type_can_end(node: Node, kind: str, ends: dict[str, bool]) -> bool:
    value, p = node.value, node.pointer
    if kind == "object":
        required = value.get("required")
        props = value.get("properties") if isinstance(value.get("properties"), dict) else {}
        for name in required if isinstance(required, list) else []:
            if not isinstance(name, str):
                continue
            where = (
                f"{p}/properties/{escape(name)}" if name in props else f"{p}/additionalProperties"
            )
            if not ends.get(where, True):
                return False
        return True
    if kind == "array":
        least = value.get("minItems")
        least = least if isinstance(least, int) and least > 0 else 0
        prefix = value.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        if not all(ends.get(f"{p}/prefixItems/{i}", True) for i in range(min(least, len(prefix)))):
            return False
        if least > len(prefix) and isinstance(value.get("items"), (dict, bool)):
            return ends.get(f"{p}/items", True)
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
    try:
        graph = SchemaGraph(schema)
    except InvalidSchema as exc:
        raise _invalid(str(exc), param) from None
    if graph.properties > limits.properties:
        raise _too_complex(f"it has {graph.properties} properties", limits.properties, param)
    if len(graph.values) > limits.nodes:
        raise _too_complex(f"it has {len(graph.values)} subschemas", limits.nodes, param)
    for pointer, node in graph.nodes.items():
        if isinstance(node.value, dict):
            _check_values(pointer, node.value, limits, param)
    components = graph.components()
    depth = _depth(graph, components)
    if depth > limits.depth:
        raise _too_complex(
            f"compiling it nests {depth} levels deep (each subschema inside another, "
            "and each '$ref' followed, is a level)",
            limits.depth,
            param,
        )
    widths = _widths(graph, components, limits.width)
    widest = max(widths, key=lambda p: widths[p])
    if widths[widest] > limits.width:
        raise _too_complex(
            f"at '#{widest}' more than {limits.width} alternatives are open at once (each "
            "optional property counts 4, the branches of an anyOf or oneOf add up, an allOf "
            "multiplies them)",
            limits.width,
            param,
        )
    endless = _endless(graph, components)
    if endless:
        raise StructureError(
            f"The schema can never be satisfied: the subschema at '#{min(endless, key=len)}' "
            "refers back to itself through '$ref' with no way to end (every branch "
            "leads back into the cycle). Give the recursion a way out: an optional "
            "property, an anyOf branch without the '$ref', or an array that may be empty.",
            code="invalid_schema",
            param=param,
        )
