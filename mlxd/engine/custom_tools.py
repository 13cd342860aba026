"""Custom (freeform) tools: a tool whose input is one string, shaped by a grammar.

OpenAI's ``custom`` tools (Codex's ``apply_patch`` is one) take free text
instead of JSON arguments, optionally in a Lark or regex grammar. A chat
template knows only function tools, so the model sees each custom tool as a
function with one string parameter, ``input`` (:func:`template_tool`).

- **Forced** (``tool_choice`` names it, or ``required`` with one tool that is
  custom): the row's whole answer is the input, generated under the tool's own
  grammar by llguidance (:func:`custom_constraint`, kind ``custom``); the
  output splitter turns the answer into one call (``engine/chat/freeform.py``).
- **Chosen by the model** in its own call format: the call's ``input`` is
  checked against the grammar (:func:`input_matches`); one that does not match
  is not a call (it is sent as text and counted as a parse failure).

Pure and MLX-free: the HTTP side builds the grammars here, and the check runs
with a byte-level llguidance tokenizer, so it needs no model.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from mlxd.engine.constraints import parser_limits, short
from mlxd.engine.messages import Constraint, CustomTool
from mlxd.engine.schema_limits import StructureError

__all__ = ["INPUT", "custom_constraint", "custom_grammar", "input_matches", "template_tool"]

# The one parameter the model sees a custom tool take.
INPUT = "input"
# The grammar of a ``text`` custom tool when it is forced: any text.
_ANY_TEXT = r"(?s:.+)"
_MATCHERS = 32


def custom_grammar(syntax: str | None, definition: Any, *, param: str) -> str | None:
    """llguidance grammar text for a custom tool's format (StructureError if it is bad).

    ``syntax`` is ``lark`` or ``regex`` (a ``grammar`` format), or None for the
    ``text`` format, which has no grammar.
    """
    if syntax is None:
        return None
    if syntax not in ("lark", "regex"):
        raise StructureError(
            f"Unknown grammar syntax {syntax!r}: use 'lark' or 'regex'.",
            code="invalid_schema",
            param=f"{param}.syntax",
        )
    if not isinstance(definition, str) or not definition.strip():
        raise StructureError(
            "A grammar format needs its 'definition' text.",
            code="invalid_schema",
            param=f"{param}.definition",
        )
    try:
        if syntax == "lark":
            grammar = LLMatcher.grammar_from_lark(definition)
        else:
            grammar = LLMatcher.grammar_from_regex(definition)
    except (ValueError, TypeError) as exc:
        raise StructureError(
            f"The grammar is not valid: {short(str(exc))}",
            code="invalid_schema",
            param=f"{param}.definition",
        ) from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, limits=parser_limits())
    if is_error:
        raise StructureError(
            f"The grammar is not valid: {short('; '.join(messages) or 'invalid grammar')}",
            code="invalid_schema",
            param=f"{param}.definition",
        )
    return grammar


def template_tool(name: str, description: str | None) -> dict[str, Any]:
    """The custom tool as the chat template sees it: a function taking one string."""
    fn: dict[str, Any] = {
        "name": name,
        "parameters": {
            "type": "object",
            "properties": {INPUT: {"type": "string"}},
            "required": [INPUT],
        },
    }
    if description is not None:
        fn["description"] = description
    return {"type": "function", "function": fn}


def custom_constraint(tool: CustomTool) -> Constraint:
    """The grammar of a forced custom call: the answer is the tool's input."""
    grammar = tool.grammar or LLMatcher.grammar_from_regex(_ANY_TEXT)
    key = hashlib.sha256(grammar.encode()).hexdigest()
    return Constraint("custom", grammar, key, tool=tool.name)


class _Bytes:
    """A tokenizer with one token per byte (and an end token), for checking text."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]
    special_token_ids = [256]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


class _Checker:
    """Compiled grammars against the byte tokenizer, in a small LRU (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()

    def matcher(self, grammar: str) -> LLMatcher:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = LLTokenizer(TokenizerWrapper(_Bytes()))
            found = self._cache.get(grammar)
            if found is None:
                found = LLMatcher(self._tokenizer, grammar, log_level=0, limits=parser_limits())
                self._cache[grammar] = found
                while len(self._cache) > _MATCHERS:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(grammar)
            return found.deep_copy()


_CHECKER = _Checker()


def input_matches(tool: CustomTool, text: str) -> bool:
    """Whether ``text`` is a whole sentence of the tool's grammar (always, for ``text``)."""
    if tool.grammar is None:
        return True
    matcher = _CHECKER.matcher(tool.grammar)
    if matcher.is_error():
        return False
    return (
        matcher.consume_tokens(list(text.encode()))
        and not matcher.is_error()
        and matcher.is_accepting()
    )
