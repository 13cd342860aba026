"""The structured-output limits, measured on schemas in pure Python before llguidance.

Each limit refuses a schema just past it with a 400 that names the limit and
the parameter, and lets one at it through; ``$ref`` cycles with no way out
are refused while recursive schemas that can end pass; references resolve
as llguidance resolves them (``#``, pointers, ``$id``, ``$anchor``).
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxd.engine.schema_limits import LIMITS, StructureError, check_schema, repeat_product


def refusal(schema: Any, param: str = "response_format.json_schema.schema") -> StructureError:
    with pytest.raises(StructureError) as err:
        check_schema(schema, param=param)
    assert err.value.param == param
    return err.value


def too_complex(schema: Any, *words: str) -> str:
    err = refusal(schema)
    assert err.code == "schema_too_complex", err
    message = str(err)
    assert "Structured output limits" in message
    for word in words:
        assert word in message, message
    return message


def chain(n: int, link=lambda nxt: nxt) -> dict[str, Any]:
    """``$defs`` d0 -> d1 -> ... -> dn, each link built around the ``$ref`` to the next."""
    defs = {f"d{i}": link({"$ref": f"#/$defs/d{i + 1}"}) for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def props(n: int, *, required: bool = False) -> dict[str, Any]:
    names = [f"p{i}" for i in range(n)]
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {k: {"type": "string"} for k in names},
    }
    if required:
        schema["required"] = names
    return schema


# ---------------------------------------------------------------- the issue's schemas


def test_the_3000_link_ref_chain_that_crashed_llguidance_is_refused():
    message = too_complex(chain(3000), "3002 levels", f"at most {LIMITS.depth}")
    assert "$ref" in message


def test_ten_thousand_properties_are_refused_by_count():
    too_complex(props(10_000), "10000 properties", f"at most {LIMITS.properties}")


def test_five_thousand_any_of_branches_are_refused():
    too_complex({"anyOf": [{"const": f"v{i}"} for i in range(5000)]}, "5000 branches")


def test_a_counted_repetition_of_a_million_is_refused():
    too_complex({"type": "string", "pattern": "(x{1000}){1000}"}, "1000000 times")


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
        # An optional property into a loop: the model could open it and never close it.
        {
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/a"}},
            "$defs": {"a": {"$ref": "#/$defs/a"}},
        },
        # A required property that is the object again: infinitely deep.
        {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
        # Every branch of the way out leads back in.
        {"anyOf": [{"$ref": "#"}, {"allOf": [{"$ref": "#"}]}]},
        {"type": "array", "minItems": 1, "items": {"$ref": "#"}},
    ],
)
def test_ref_cycles_with_no_way_out_are_refused(schema):
    err = refusal(schema)
    assert err.code == "invalid_schema"
    assert "can never be satisfied" in str(err) and "way out" in str(err)


@pytest.mark.parametrize(
    "schema",
    [
        # A tree: children may be empty.
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#"}},
            },
            "required": ["name", "children"],
        },
        # A linked list: next may be null.
        {
            "type": "object",
            "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["next"],
        },
        # An untyped recursive object can be a string.
        {"properties": {"x": {"$ref": "#"}}, "required": ["x"]},
        # Mutual recursion through an optional property.
        {
            "$ref": "#/$defs/a",
            "$defs": {
                "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}},
                "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}},
            },
        },
    ],
)
def test_recursive_schemas_that_can_end_pass(schema):
    check_schema(schema, param="p")


def test_a_large_recursive_expression_grammar_passes():
    # 40 node kinds, each referring to the expression that refers to all of them.
    kinds = {
        f"k{i}": {
            "type": "object",
            "properties": {
                "op": {"const": f"k{i}"},
                "args": {"type": "array", "items": {"$ref": "#/$defs/expr"}},
            },
            "required": ["op", "args"],
        }
        for i in range(40)
    }
    expr = {"anyOf": [{"$ref": f"#/$defs/k{i}"} for i in range(40)] + [{"type": "number"}]}
    check_schema({"$defs": {"expr": expr, **kinds}, "$ref": "#/$defs/expr"}, param="p")


# ---------------------------------------------------------------- each limit, at and past it


def test_depth_counts_nesting_and_each_ref_followed():
    check_schema(chain(LIMITS.depth - 2), param="p")  # the root, the links, the target
    too_complex(chain(LIMITS.depth - 1), f"{LIMITS.depth + 1} levels")
    # A property per link doubles the levels.
    prop = lambda nxt: {"type": "object", "properties": {"a": nxt}}  # noqa: E731
    check_schema(chain(LIMITS.depth // 2 - 1, prop), param="p")
    too_complex(chain(LIMITS.depth // 2, prop), "levels")
    nested: dict[str, Any] = {"type": "string"}
    for _ in range(30):  # plain nesting, far inside the limit
        nested = {"type": "array", "items": nested}
    check_schema(nested, param="p")


def test_width_counts_optional_properties_and_branches():
    most = (LIMITS.width - 7) // 4
    check_schema(props(most), param="p")
    too_complex(props(most + 1), "alternatives are open at once")
    check_schema(props(LIMITS.properties, required=True), param="p")  # required ones are cheap
    # Ten branches of 100 optional properties each: 4,070 Earley items in llguidance.
    branches = {
        "anyOf": [{"type": "object", "properties": props(100)["properties"]} for _ in range(10)]
    }
    too_complex(branches, "at '#'")
    # allOf multiplies: 100 x 100 consts is 10,000 intersections.
    hundred = {"anyOf": [{"const": i} for i in range(100)]}
    too_complex({"allOf": [hundred, hundred]}, "alternatives")
    check_schema({"allOf": [hundred, {"type": "integer"}]}, param="p")


def test_counts():
    check_schema({"enum": list(range(LIMITS.enum))}, param="p")
    too_complex({"enum": list(range(LIMITS.enum + 1))}, f"{LIMITS.enum + 1} values")
    check_schema({"oneOf": [{"const": i} for i in range(LIMITS.branches)]}, param="p")
    too_complex({"oneOf": [{"const": i} for i in range(LIMITS.branches + 1)]}, "oneOf")
    too_complex(props(LIMITS.properties + 1, required=True), "properties")
    many = {"$defs": {f"d{i}": {"type": "string"} for i in range(LIMITS.nodes)}}
    too_complex(many, f"{LIMITS.nodes + 1} subschemas")
    too_complex({"description": "x" * LIMITS.json_chars}, "characters of JSON")


def test_patterns():
    check_schema({"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"}, param="p")
    check_schema({"type": "string", "pattern": f"^x{{{LIMITS.repeat}}}$"}, param="p")
    too_complex({"type": "string", "pattern": f"x{{{LIMITS.repeat + 1}}}"}, "repeats")
    too_complex({"type": "string", "pattern": "a" * (LIMITS.pattern_chars + 1)}, "characters long")
    # Pattern properties' names are patterns too.
    too_complex({"type": "object", "patternProperties": {"(a{50}b){30}": {}}}, "repeats")


@pytest.mark.parametrize(
    ("pattern", "product"),
    [
        ("abc", 1),
        ("a{3}", 3),
        ("a{2,5}", 5),
        ("a{7,}", 7),
        ("(a{3}b){4}", 12),
        ("((x{10}){10}){10}", 1000),
        ("[ab]{2}|c{5}", 5),
        ("[{]{3}", 3),  # a brace in a class is a character
        (r"\{5\}x{2}", 2),  # escaped braces are characters
        (r"\p{L}{4}", 4),  # a Unicode class is one atom
        ("(?:a{2}){3}", 6),
        ("a{x}", 1),  # not a repetition
    ],
)
def test_repeat_product(pattern, product):
    assert repeat_product(pattern) == product


# ---------------------------------------------------------------- references and shapes


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#/definitions/a", "definitions": {"a": {"type": "string"}}},
        {"$ref": "#/$defs/a~1b", "$defs": {"a/b": {"type": "string"}}},
        {"$ref": "#/$defs/a%20b", "$defs": {"a b": {"type": "string"}}},
        {"$ref": "#/properties/a", "properties": {"a": {"type": "integer"}}},
        {"$id": "urn:x", "$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}},
        {"$ref": "#name", "$defs": {"a": {"$anchor": "name", "type": "string"}}},
        {"$ref": "urn:inner", "$defs": {"a": {"$id": "urn:inner", "type": "string"}}},
        {
            "type": "object",
            "properties": {
                "a": {
                    "$id": "https://example.com/a.json",
                    "$ref": "#/$defs/x",
                    "$defs": {"x": {"type": "integer"}},
                }
            },
        },
        True,
    ],
)
def test_references_resolve_within_the_schema(schema):
    check_schema(schema, param="p")


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"$ref": "http://example.com/x.json"}, "points outside the schema"),
        ({"$ref": "#/$defs/missing", "$defs": {}}, "names no subschema"),
        ({"$ref": 3}, "not a string"),
        ({"type": "nonsense"}, "'type' at '#' is 'nonsense'"),
        ({"type": "object", "properties": {"a": 5}}, "'#/properties/a' is a int"),
        ([], "object or a boolean"),
    ],
)
def test_invalid_schemas_are_named(schema, words):
    err = refusal(schema)
    assert err.code == "invalid_schema"
    assert words in str(err), str(err)
