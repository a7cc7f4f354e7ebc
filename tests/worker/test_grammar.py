"""response_format on a tiny Llama with random weights (both caches): the grammar forces the structure,
so the output parses as JSON and matches the schema whatever the weights; bad schemas are refused by name."""

from __future__ import annotations

import json

import pytest

from kvpact.shared.errors import RequestError
from kvpact.v1 import generation_pb2
from kvpact.worker.engine.engine import Engine
from kvpact.worker.engine.request import FinishReason, GenerationRequest, ResponseFormat, SamplingParams
from kvpact.worker.generate_pb import request_from_pb

MODES = {"eager": dict(mode="off"), "paged": dict(mode="on", context_tokens=2048)}
SCHEMA = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["count", "color"],
    "additionalProperties": False,
}


@pytest.fixture(params=list(MODES))
def engine(request, make_engine, tiny_llama) -> Engine:
    return make_engine(tiny_llama, max_model_len=256, **MODES[request.param])


def constrained(request_id: str, schema: str | None, **sampling: float) -> GenerationRequest:
    return GenerationRequest(
        request_id,
        "Describe the thing as JSON:",
        SamplingParams(**sampling) if sampling else SamplingParams(temperature=0.0),
        max_tokens=64,
        response_format=ResponseFormat(json_schema=schema),
    )


def test_a_json_schema_output_parses_and_matches_the_schema(engine):
    requests = [constrained("greedy", json.dumps(SCHEMA))] + [
        constrained(f"seed{i}", json.dumps(SCHEMA), temperature=1.0, seed=i) for i in range(3)
    ]
    for result in engine.run(requests, timeout=120):
        assert result.finish_reason is FinishReason.STOP, result.text
        value = json.loads(result.text)
        assert set(value) == {"count", "color"}, value
        assert isinstance(value["count"], int) and 0 <= value["count"] <= 99
        assert value["color"] in {"red", "green", "blue"}
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_unconstrained_requests_in_the_same_batch_are_untouched(engine):
    free = GenerationRequest(
        "free", "Describe the thing as JSON:", SamplingParams(temperature=0.0), max_tokens=12
    )
    (alone,) = engine.run([free], timeout=60)
    free.request_id = "free2"
    together = engine.run([constrained("json", json.dumps(SCHEMA)), free], timeout=60)
    assert together[1].token_ids == alone.token_ids


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ("{not json", "response_format.json_schema is not valid JSON"),
        ('{"type": 5}', "response_format.json_schema is not a JSON Schema this worker can enforce"),
    ],
)
def test_an_invalid_schema_is_refused_naming_the_field(engine, schema, message):
    with pytest.raises(RequestError) as info:
        engine.run([constrained("bad", schema)], timeout=60)
    assert message in str(info.value) and "json_schema_converter" not in str(info.value)


def test_the_wire_maps_both_kinds_and_refuses_an_empty_one():
    schema = json.dumps(SCHEMA)
    msg = generation_pb2.GenerateRequest(
        text="x", response_format=generation_pb2.ResponseFormat(json_schema=schema)
    )
    assert request_from_pb(msg, "r").response_format == ResponseFormat(json_schema=schema)
    msg = generation_pb2.GenerateRequest(
        text="x", response_format=generation_pb2.ResponseFormat(json_object=True)
    )
    assert request_from_pb(msg, "r").response_format == ResponseFormat()
    msg = generation_pb2.GenerateRequest(
        text="x", response_format=generation_pb2.ResponseFormat(json_object=False)
    )
    with pytest.raises(RequestError, match="response_format is set but asks for nothing"):
        request_from_pb(msg, "r")
    with pytest.raises(RequestError, match="min_tokens cannot be combined with response_format"):
        GenerationRequest("r", "x", min_tokens=2, response_format=ResponseFormat()).validate()


def test_json_object_output_is_one_json_object(engine):
    (result,) = engine.run([constrained("obj", None, temperature=1.0, seed=3)], timeout=60)
    assert result.finish_reason is FinishReason.STOP
    assert isinstance(json.loads(result.text), dict)
