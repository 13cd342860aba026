"""The JSON schemas the structured-output tests and benchmark use.

Bounded on purpose (string lengths, item counts, integer ranges, enums), so
even a random-weight model's constrained output ends within a few dozen
tokens. Together they cover nested objects, arrays with min/max items, enums,
integer ranges, strings with a pattern and a max length, anyOf, $defs/$ref,
optional fields and const/null.
"""

from __future__ import annotations

from typing import Any

JSON_SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "integer_range": {"type": "integer", "minimum": -5, "maximum": 5},
    "pattern_max_length": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,3}$", "maxLength": 5}
        },
        "required": ["code"],
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {"type": "boolean"},
            {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 3}},
                "required": ["n"],
                "additionalProperties": False,
            },
        ]
    },
    "defs_ref": {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "req": {"type": "boolean"},
            "opt": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["req"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 99},
                "ok": {"type": "boolean"},
            },
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "const_null": {
        "type": "object",
        "properties": {"v": {"const": "x1"}, "z": {"type": "null"}},
        "required": ["v", "z"],
        "additionalProperties": False,
    },
    "min_length_enum_items": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "s": {"type": "string", "minLength": 2, "maxLength": 4},
        },
        "required": ["tags", "s"],
        "additionalProperties": False,
    },
}
