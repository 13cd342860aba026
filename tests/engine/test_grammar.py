"""The llguidance pieces on a real tokenizer: mask application, the compiled-grammar
LRU, every EOS id, and the row processor's think gate. No model weights run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.engine.chat.grammar import (
    ConstraintProcessor,
    GrammarError,
    GrammarFailure,
    Grammars,
    apply_mask,
    make_ll_tokenizer,
)
from mlxd.engine.constraints import (
    StructureError,
    check_constraint,
    json_constraint,
    tool_constraint,
    validate_constraint,
)
from tests.support.tinymodels import tiny_model_dir

WIDTH = 544  # padded past the 514-token vocabulary, like real checkpoints


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(Path(tiny_model_dir("llama", template="hermes_think")))


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(make_ll_tokenizer(tok, WIDTH), WIDTH, capacity=2)


def bits(bitmask: bytes) -> np.ndarray:
    return np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:WIDTH]


def test_portable_mask_matches_llguidance_numpy_reference():
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=(1, WIDTH)).astype(np.float32)
        mask = rng.integers(-(2**31), 2**31, size=(1, (WIDTH + 31) // 32), dtype=np.int64)
        mask = mask.astype(np.int32)
        expected = logits.copy()
        apply_token_bitmask_inplace(expected, mask)
        got = apply_mask(mx.array(logits), mask.tobytes(), metal=False)
        assert np.array_equal(np.array(got), expected)


@pytest.mark.skipif(not mx.metal.is_available(), reason="llguidance's Metal kernel needs Metal")
def test_metal_kernel_matches_the_portable_path():  # pragma: no cover - Apple silicon only
    rng = np.random.default_rng(1)
    logits = mx.array(rng.normal(size=(1, WIDTH)).astype(np.float32))
    mask = rng.integers(0, 2**31, size=((WIDTH + 31) // 32,), dtype=np.int64).astype(np.int32)
    a = apply_mask(logits, mask.tobytes(), metal=True)
    b = apply_mask(logits, mask.tobytes(), metal=False)
    assert np.array_equal(np.array(a), np.array(b))


def test_masks_are_sized_to_the_logits_and_allow_every_eos(tok, grammars):
    c = json_constraint({"enum": ["x"]}, strict=True, param="p")
    matcher = grammars.matcher(c)
    for t in tok.encode('"x"', add_special_tokens=False):
        assert bits(matcher.compute_bitmask())[t]
        assert matcher.consume_token(t)
    end = bits(matcher.compute_bitmask())
    assert set(np.nonzero(end)[0]) == set(tok.eos_token_ids)
    assert len(matcher.compute_bitmask()) * 8 >= WIDTH


def test_compiled_grammars_are_cached_by_hash_with_lru_eviction(grammars):
    a, b, c = (json_constraint({"const": n}, strict=True, param="p") for n in (1, 2, 3))
    assert grammars.warm(a)[1] is False
    assert grammars.warm(a)[1] is True
    assert a.key == json_constraint({"const": 1}, strict=True, param="p").key
    grammars.warm(b)
    grammars.warm(c)  # capacity 2: a is evicted
    assert grammars.warm(a)[1] is False
    # Each row gets its own matcher: consuming in one leaves the other fresh.
    m1, m2 = grammars.matcher(b), grammars.matcher(b)
    assert m1.consume_token(m1_first := int(np.nonzero(bits(m1.compute_bitmask()))[0][0]))
    assert bits(m2.compute_bitmask())[m1_first]


def checked(schema: Any, *, strict: bool, grammars: Grammars | None = None) -> None:
    """A schema through every check before queueing: limits, then llguidance (either way)."""
    c = json_constraint(schema, strict=strict, param="response_format")
    check_constraint(c)
    if grammars is None:
        validate_constraint(c, "response_format")
    else:
        grammars.warm(c)


def test_strict_refuses_unenforceable_keywords_and_names_them(grammars):
    for keyword, schema in (
        ("uniqueItems", {"type": "array", "uniqueItems": True}),
        ("not", {"not": {"type": "string"}}),
    ):
        with pytest.raises(StructureError, match=keyword) as err:
            checked(schema, strict=True)
        assert err.value.code == "invalid_schema"
        with pytest.raises(GrammarError, match=keyword):
            checked(schema, strict=True, grammars=grammars)
        checked(schema, strict=False)  # ignored when lenient
        checked(schema, strict=False, grammars=grammars)
    with pytest.raises(StructureError):
        checked({"type": "bogus"}, strict=False)


def test_tool_formats_without_a_grammar_are_refused_by_name():
    tools = [{"name": "f", "parameters": {"type": "object"}, "strict": False}]
    with pytest.raises(StructureError, match="some_newer_format") as err:
        tool_constraint(tools, tool_format="some_newer_format", parallel=False, param="tool_choice")
    assert err.value.code == "tool_format_unsupported"


def test_processor_starts_masking_after_think_end(tok, grammars):
    c = json_constraint({"type": "boolean"}, strict=True, param="p")
    proc = ConstraintProcessor(
        grammars.matcher(c), think_end=tok.think_end_tokens, reasoning=True, metal=False
    )
    logits = mx.zeros((1, WIDTH))
    prompt = mx.array([1, 2, 3])
    assert np.isfinite(np.array(proc(prompt, logits))).all()  # reasoning: free
    free = mx.concatenate([prompt, mx.array([5])])
    assert np.isfinite(np.array(proc(free, logits))).all()
    ended = mx.concatenate([free, mx.array([tok.think_end_id])])
    masked = np.array(proc(ended, logits))[0]
    allowed = set(np.nonzero(np.isfinite(masked))[0])
    first = {t for t in allowed if tok.decode([t]) and tok.decode([t])[0] in "tf"}
    assert allowed and allowed == first
    token = int(min(allowed))
    after = mx.concatenate([ended, mx.array([token])])
    proc(after, logits)
    bad = next(t for t in range(WIDTH) if t not in allowed and t not in tok.eos_token_ids)
    with pytest.raises(GrammarError):
        proc(mx.concatenate([after, mx.array([bad])]), logits)


def test_json_tools_grammar_makes_parseable_calls(tok):
    g = Grammars(make_ll_tokenizer(tok, WIDTH), WIDTH)
    tools = [
        {
            "name": "pick",
            "parameters": {"type": "object", "properties": {"n": {"enum": [1, 2]}}},
            "strict": False,
        }
    ]
    c = tool_constraint(tools, tool_format="json_tools", parallel=False, param="tool_choice")
    matcher = g.matcher(c)
    text = '<tool_call>\n{"name":"pick","arguments":{"n":2}}\n</tool_call>'
    assert matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
    assert matcher.is_accepting()
    body = text.removeprefix("<tool_call>").removesuffix("</tool_call>")
    assert tok.tool_parser(body, None) == json.loads(body)


# ---------------------------------------------------------------- limits and failures

# Schemas at the structured-output limits (mlxd.engine.schema_limits), each the
# worst of its shape: a subprocess compiles them for the tiny tokenizer on a
# thread with a 2 MiB stack (a quarter of the 8 MiB threads get) and feeds the
# first tokens of an answer. A crash is a non-zero exit, never a dead test run.
AT_THE_LIMITS = r"""
import json, sys, threading
from pathlib import Path
from llguidance import LLMatcher, LLTokenizer
from mlxd.engine.constraints import check_constraint, json_constraint, parser_limits
from mlxd.engine.schema_limits import LIMITS

tok = LLTokenizer(Path(sys.argv[1], "tokenizer.json").read_text())

def chain(n, link):
    defs = {f"d{i}": link({"$ref": f"#/$defs/d{i + 1}"}) for i in range(n)}
    defs[f"d{n}"] = {"type": "object"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}

def optional(n):
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}

widest = (LIMITS.width - 7) // 4
cases = {
    "ref": chain(LIMITS.depth - 2, lambda r: r),
    "properties": chain(
        LIMITS.depth // 2 - 1, lambda r: {"type": "object", "properties": {"a": r}}
    ),
    "items": chain(LIMITS.depth // 2 - 1, lambda r: {"type": "array", "items": r}),
    "anyOf": chain(LIMITS.depth // 2 - 1, lambda r: {"anyOf": [r, {"type": "null"}]}),
    "width": optional(widest),
    "branches": {"anyOf": [optional(widest // 10) for _ in range(9)]},
}

failed = []

def run():
    try:
        each()
    except BaseException as exc:
        failed.append(repr(exc))

def each():
    for name, schema in cases.items():
        c = json_constraint(schema, strict=False, param="p")
        check_constraint(c)
        m = LLMatcher(tok, c.grammar, log_level=0, limits=parser_limits())
        for t in tok.tokenize_str('{"' if name != "items" else "[["):
            m.compute_bitmask()
            assert m.consume_token(t), (name, m.get_error())
        assert not m.is_error(), (name, m.get_error())
        print(name, "ok", flush=True)

threading.stack_size(2 * 1024 * 1024)
t = threading.Thread(target=run)
t.start()
t.join()
sys.exit(f"failed: {failed[0]}" if failed else 0)
"""


def test_schemas_at_the_limits_compile_and_start_on_a_small_stack():
    import subprocess
    import sys

    model = tiny_model_dir("llama", template="hermes_think")
    done = subprocess.run(
        [sys.executable, "-c", AT_THE_LIMITS, str(model)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    names = ("ref", "properties", "items", "anyOf", "width", "branches")
    assert done.stdout.split() == [w for n in names for w in (n, "ok")], done.stdout


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
        {"type": "object", "required": ["a"], "properties": {"a": False}},
    ],
)
def test_a_grammar_that_accepts_nothing_is_refused_when_compiled(grammars, schema):
    # What the limits would refuse first, straight to the compiler: never an empty answer.
    with pytest.raises(GrammarError, match=r"accepts no output|[Uu]nsatisfiable"):
        grammars.warm(json_constraint(schema, strict=False, param="p"))


def test_llguidance_failing_mid_generation_fails_the_row_as_the_schemas_400(tok, grammars):
    # 600 optional properties (past the width limit, compiled directly): after
    # "{" llguidance's row holds 2,407 Earley items, over its 2,000.
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
    proc = ConstraintProcessor(grammars.matcher(json_constraint(schema, strict=False, param="p")))
    prompt = mx.array([1, 2, 3])
    logits = mx.zeros((1, WIDTH))
    proc(prompt, logits)
    brace = tok.encode("{", add_special_tokens=False)
    with pytest.raises(GrammarFailure) as err:
        proc(mx.concatenate([prompt, mx.array(brace)]), logits)
        proc(mx.concatenate([prompt, mx.array(brace + brace)]), logits)
    assert err.value.code == "schema_too_complex" and err.value.status == 400
    assert "Structured output limits" in str(err.value)


def test_hermes_tool_parameters_are_the_root_of_their_own_refs(tok, grammars):
    # Nested in the call object, "#/$defs/city" once pointed at the call object.
    params = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/city"}},
        "required": ["where"],
        "$defs": {"city": {"enum": ["Oslo", "Rome"]}},
    }
    tools = [
        {"name": "weather", "parameters": params, "strict": False},
        {"name": "other", "parameters": {"type": "object", "properties": {}}, "strict": False},
    ]
    c = tool_constraint(tools, tool_format="json_tools", parallel=False, param="tool_choice")
    matcher = grammars.matcher(c)
    text = '<tool_call>\n{"name":"weather","arguments":{"where":"Rome"}}\n</tool_call>'
    assert matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
    assert matcher.is_accepting()


def _longest(matcher: Any, tok: Any, prefix: str, text: str) -> int:
    """How many characters of ``text`` the matcher takes after ``prefix``."""
    assert matcher.consume_tokens(tok.encode(prefix, add_special_tokens=False))
    taken = 0
    for ch in text:
        if not matcher.consume_tokens(tok.encode(ch, add_special_tokens=False)):
            break
        taken += 1
    return taken


def test_numbers_a_schema_leaves_unbounded_stop_after_15_digits(tok, grammars):
    """Issue 33 item 4: docs/tools.md's ``population_millions: int`` ran to max_tokens."""
    city = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "population_millions": {"type": "integer"}},
        "required": ["population_millions"],
    }
    c = json_constraint(city, strict=True, param="response_format")
    assert _longest(grammars.matcher(c), tok, '{"population_millions":', "1" * 40) == 15
    ratio = {"type": "object", "properties": {"r": {"type": "number"}}, "required": ["r"]}
    c = json_constraint(ratio, strict=True, param="response_format")
    assert _longest(grammars.matcher(c), tok, '{"r":1.', "1" * 40) == 6  # 6 decimals
    # A bound the schema sets itself stays (here more digits than the default cap).
    big = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 10**17}}}
    c = json_constraint(big, strict=True, param="response_format")
    assert _longest(grammars.matcher(c), tok, '{"n":', "1" * 40) == 17
    # Enforced tool arguments get the same cap.
    tools = [
        {
            "name": "f",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
            "strict": False,
        }
    ]
    c = tool_constraint(tools, tool_format="json_tools", parallel=False, param="tool_choice")
    prefix = '<tool_call>\n{"name":"f","arguments":{"n":'
    assert _longest(grammars.matcher(c), tok, prefix, "1" * 40) == 15


def test_bounded_numbers_keeps_what_the_schema_says():
    from mlxd.engine.constraints import NUMBER_BOUND, bounded_numbers

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": ["integer", "null"]},
            "b": {"type": "number", "minimum": 0, "multipleOf": 0.5},
            "c": {"type": "integer", "exclusiveMinimum": 10**18},
            "enum": {"enum": [{"type": "integer"}]},
        },
    }
    out = bounded_numbers(schema)
    props = out["properties"]
    assert props["a"] == {
        "type": ["integer", "null"],
        "minimum": -NUMBER_BOUND,
        "maximum": NUMBER_BOUND,
    }
    assert props["b"] == {
        "type": "number",
        "minimum": 0,
        "multipleOf": 0.5,
        "maximum": NUMBER_BOUND,
    }
    assert props["c"]["maximum"] == 10**18 + NUMBER_BOUND and "minimum" not in props["c"]
    assert props["enum"] == {"enum": [{"type": "integer"}]}  # data, not a schema
    assert "minimum" not in schema["properties"]["a"]  # the request's schema is not changed


def test_json_tools_grammar_lets_a_newline_end_the_calls(tok):
    """Issue 33 item 3: after a call, "\\n" could only open another call, so the demo
    model, which writes "\\n" after "</tool_call>", repeated its call under "required"."""
    g = Grammars(make_ll_tokenizer(tok, WIDTH), WIDTH)
    tools = [{"name": "f", "parameters": {"type": "object"}, "strict": False}]
    c = tool_constraint(tools, tool_format="json_tools", parallel=True, param="tool_choice")
    call = '<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>'
    for tail in ("", "\n", "\n\n", "\n" + call):  # the last: parallel calls still work
        matcher = g.matcher(c)
        assert matcher.consume_tokens(tok.encode(call + tail, add_special_tokens=False)), tail
        assert matcher.is_accepting(), repr(tail)
    matcher = g.matcher(c)
    assert not matcher.consume_tokens(tok.encode(call + "\n\nmore", add_special_tokens=False))
