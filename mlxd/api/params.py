"""Request values every API validates alike: sampling, penalties, stops, max tokens, faults.

Each API reads its own body shape (:mod:`mlxd.api.openai.schema`,
:mod:`mlxd.api.responses.schema`, :mod:`mlxd.api.anthropic.schema`) and
checks the values through here, so a bound is written once and a refusal
reads the same everywhere. Errors are :class:`~mlxd.api.http.errors.OpenAIError`
400s naming the parameter as the request names it (:func:`relabel` renames a
shared validator's parameter for another API).
"""

from __future__ import annotations

import re

from mlxd.api.http.errors import OpenAIError
from mlxd.config import Settings
from mlxd.engine import PenaltyParams, SamplingParams

# Bounds on what a body may carry (docs/api.md, "Limits").
MAX_LOGIT_BIAS = 300
MAX_STOPS = 16
MAX_STOP_CHARS = 500
# OpenAI's bounds on ``metadata``: pairs, key and value characters.
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

_TOKEN_ID = re.compile(r"^[0-9]{1,10}$")
_FAULT = re.compile(r"^((logits_processor|bad_logits)(@[1-9][0-9]{0,5})?|never_admit)$")


def bad(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    """A 400 for a value mlxd cannot take."""
    return OpenAIError(400, message, code=code, param=param)


def unsupported(param: str, what: str) -> OpenAIError:
    """A 400 for a parameter of the API that mlxd does not implement (never ignored silently)."""
    return OpenAIError(
        400,
        f"'{param}' is not supported by mlxd: {what}",
        code="unsupported_parameter",
        param=param,
    )


def relabel(exc: OpenAIError, old: str, new: str) -> OpenAIError:
    """A shared validator's error, with its parameter named as this API names it."""
    if exc.param:
        exc.param = exc.param.replace(old, new, 1)
    exc.message = exc.message.replace(old, new)
    exc.args = (exc.message,)
    return exc


def check_range(
    name: str, value: float | None, lo: float, hi: float, *, lo_open: bool = False
) -> None:
    """``value`` in ``[lo, hi]`` (``(lo, hi]`` when ``lo_open``); None passes, NaN does not."""
    if value is None:
        return
    if value != value or value > hi or value < lo or (lo_open and value == lo):
        bound = f"({lo}" if lo_open else f"[{lo}"
        raise bad(name, f"'{name}' must be in {bound}, {hi}], got {value}.")


def max_tokens(name: str, value: int | None, settings: Settings) -> int | None:
    """A request's token cap: at least 1 and at most ``[limits] max_tokens``; None passes."""
    if value is None:
        return None
    if value < 1:
        raise bad(name, f"'{name}' must be at least 1, got {value}.")
    limit = settings.limits.max_tokens
    if value > limit:
        raise bad(name, f"'{name}' is {value}; this server allows at most {limit}.")
    return value


def clamped_max_tokens(
    name: str, value: int | None, settings: Settings
) -> tuple[int | None, int | None]:
    """A request's token cap, clamped to ``[limits] max_tokens``, and what was asked if above.

    Agents ask for long budgets (opencode 32000, Claude Code 32000) and expect
    the server to stop at its own limit: the answer ends there with
    ``finish_reason`` ``length`` (``X-Mlxd-Max-Tokens`` says so). Below 1 is
    still a 400 (a non-integer is refused by the schema).
    """
    if value is None:
        return None, None
    limit = settings.limits.max_tokens
    if value > limit:
        return limit, value
    return max_tokens(name, value, settings), None


def max_tokens_header(limit: int, asked: int) -> str:
    """``X-Mlxd-Max-Tokens``'s value when a request's cap was clamped."""
    return f"{limit}; requested={asked}"


def sampling(
    settings: Settings,
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
) -> SamplingParams:
    """Sampling parameters from a request's values and ``[sampling]`` defaults (validated)."""
    check_range("temperature", temperature, 0, 2)
    check_range("top_p", top_p, 0, 1, lo_open=True)
    check_range("min_p", min_p, 0, 1)
    if top_k is not None and top_k < 0:
        raise bad("top_k", f"'top_k' must be >= 0, got {top_k}.")
    d = settings.sampling
    return SamplingParams(
        temperature=d.temperature if temperature is None else temperature,
        top_p=d.top_p if top_p is None else top_p,
        top_k=d.top_k if top_k is None else top_k,
        min_p=d.min_p if min_p is None else min_p,
        seed=_seed(seed),
    )


def penalties(
    *,
    presence: float | None,
    frequency: float | None,
    repetition: float | None,
    logit_bias: dict[str, float] | None,
) -> PenaltyParams:
    """OpenAI's presence and frequency penalties, mlx-lm's repetition penalty, a logit bias."""
    check_range("presence_penalty", presence, -2, 2)
    check_range("frequency_penalty", frequency, -2, 2)
    check_range("repetition_penalty", repetition, 0, 10, lo_open=True)
    return PenaltyParams(
        repetition_penalty=repetition,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logit_bias=_logit_bias(logit_bias),
    )


def stops(stop: str | list[str] | None, name: str = "stop") -> tuple[str, ...]:
    """At most 16 stop sequences of at most 500 characters each; empty ones dropped."""
    if stop is None:
        return ()
    given = [stop] if isinstance(stop, str) else stop
    if len(given) > MAX_STOPS:
        raise bad(name, f"At most {MAX_STOPS} stop sequences are allowed.")
    for s in given:
        if len(s) > MAX_STOP_CHARS:
            raise bad(name, f"A stop sequence may have at most {MAX_STOP_CHARS} characters.")
    return tuple(s for s in given if s)


def fault(value: str | None, *, allowed: bool, refusal: OpenAIError) -> str | None:
    """The test-only ``mlxd_fault``: ``refusal`` unless the server enables fault injection."""
    if value is None:
        return None
    if not allowed:
        raise refusal
    if not _FAULT.match(value):
        raise bad("mlxd_fault", f"unknown fault {value!r}")
    return value


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """Keys are token ids (checked against the vocabulary at intake), values in [-100, 100]."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad(
            "logit_bias", f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} allowed."
        )
    out = []
    for key, value in bias.items():
        if not _TOKEN_ID.match(key):
            raise bad(
                "logit_bias", f"logit_bias keys must be token ids (0, 1, 2, ...), got {key[:40]!r}."
            )
        check_range("logit_bias", value, -100, 100)
        out.append((int(key), float(value)))
    return tuple(out)


def _seed(seed: int | None) -> int | None:
    """Seeds are 64-bit: [-2**63, 2**64 - 1]; a negative one is taken modulo 2**64."""
    if seed is None:
        return None
    if not SEED_MIN <= seed <= SEED_MAX:
        raise bad("seed", f"'seed' must be between {SEED_MIN} and {SEED_MAX}, got {seed}.")
    return seed % 2**64


def metadata(value: dict[str, str] | None, name: str = "metadata") -> None:
    """``metadata`` within OpenAI's bounds: 16 pairs, 64-character keys, 512-character values."""
    if value is None:
        return
    if len(value) > MAX_METADATA:
        raise bad(
            name,
            f"'{name}' has {len(value)} pairs; at most {MAX_METADATA} are allowed.",
        )
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise bad(
                name,
                f"A key of '{name}' is {len(key)} characters; at most {MAX_METADATA_KEY} "
                "are allowed.",
            )
        if len(item) > MAX_METADATA_VALUE:
            raise bad(
                f"{name}.{key}",
                f"'{name}.{key}' is {len(item)} characters; at most {MAX_METADATA_VALUE} "
                "are allowed.",
            )


def stream_options(given: bool, stream: bool | None) -> None:
    """``stream_options`` only with ``stream: true`` (as OpenAI)."""
    if given and not stream:
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true.")
