"""The openai SDK end to end on the demo model (SmolLM2-135M-Instruct) with tools and
structured output.

SmolLM2's own template has no tools, so the daemon serves it with a Hermes-style
tools template (``[model] chat_template``) and mlx-lm's ``json_tools`` parser
(``[model] tool_parser``): exactly what a user does for such a model.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.support.daemon import Daemon, toml_config
from tests.support.schemas import JSON_SCHEMAS
from tests.support.tinymodels import TEMPLATES

pytestmark = pytest.mark.slow


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=50)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def daemon(daemons, tmp_path_factory: pytest.TempPathFactory):
    template = tmp_path_factory.mktemp("demo-tools") / "hermes.jinja"
    template.write_text(TEMPLATES["hermes"][0])
    config = toml_config(
        model={"chat_template": str(template), "tool_parser": "json_tools"},
        batch={"size": 12},  # the 11 schemas below in one batch
        sampling={"max_tokens": 96},
    )
    return daemons.get(config)


@pytest.fixture(scope="module")
def client(daemon: Daemon):
    return daemon.openai()


@pytest.fixture(scope="module")
def model(client) -> str:
    (entry,) = client.models.list().data
    return entry.id


def test_parse_returns_a_parsed_instance(client, model):
    done = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe the capital of France as JSON."}],
        response_format=City,
        temperature=0,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    city = choice.message.parsed
    assert isinstance(city, City)
    jsonschema.validate(json.loads(choice.message.content), City.model_json_schema())


class DocsCity(BaseModel):
    """docs/tools.md's structured-output example, verbatim."""

    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=100)


class UnboundedCity(BaseModel):
    name: str
    country: str
    population_millions: int


@pytest.mark.parametrize("shape", [DocsCity, UnboundedCity])
def test_the_docs_structured_output_example_finishes(client, model, shape):
    """Issue 33 item 4: an unbounded int used to run to max_tokens (LengthFinishReasonError)."""
    done = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=shape,
        max_tokens=200,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, shape)
    assert abs(choice.message.parsed.population_millions) < 10**15


def test_required_tool_choice_returns_a_valid_call(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_streamed_tool_calls_equal_the_non_streamed_ones(client, model):
    kw = {
        "model": model,
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
    }
    whole = client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    pairs = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == pairs
    assert final.finish_reason == whole.finish_reason == "tool_calls"


def test_a_tool_result_turn_gets_an_answer(client, model):
    first = (
        client.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0
        )
        .choices[0]
        .message
    )
    call = first.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."},
    ]
    reply = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=40
    )
    assert reply.choices[0].message.content or reply.choices[0].message.tool_calls


def test_every_test_schema_validates_on_the_demo_model(client, model):
    """The 11 schemas of the tiny-model tests, concurrently (they batch), on a real model."""

    def ask(name: str, stream: bool = False):
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": name, "schema": JSON_SCHEMAS[name], "strict": True},
        }
        kw = {
            "model": model,
            "messages": [{"role": "user", "content": f"Give me {name.replace('_', ' ')} data."}],
            "response_format": fmt,
            "temperature": 0,
            "max_tokens": 96,
        }
        if not stream:
            return client.chat.completions.create(**kw).choices[0]
        with client.chat.completions.stream(**kw) as s:
            return s.get_final_completion().choices[0]

    names = sorted(JSON_SCHEMAS)
    with ThreadPoolExecutor(len(names)) as pool:
        answers = dict(zip(names, pool.map(ask, names), strict=True))
    for name, choice in answers.items():
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), JSON_SCHEMAS[name])
    streamed = ask("nested", stream=True)
    assert streamed.message.content == answers["nested"].message.content
