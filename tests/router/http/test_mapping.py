"""The HTTP front's pure parts (no server): each accepted OpenAI parameter lands on the GenerateRequest
field it maps to, neutral values of refused parameters pass while any other value is refused by name,
and chunks render into OpenAI's shapes (router/http/requests.py, schema.py, responses.py, errors.py)."""

from __future__ import annotations

import json

import grpc
import pytest
from pydantic import ValidationError

from kvpact.router.errors import WorkerCallFailed
from kvpact.router.http import errors
from kvpact.router.http.errors import HttpError
from kvpact.router.http.requests import chat_request, completion_requests
from kvpact.router.http.responses import Rendering
from kvpact.router.http.schema import ChatCompletionRequest, CompletionRequest
from kvpact.v1 import generation_pb2

CHAT = [
    {"role": "developer", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
]


SCHEMA = {"name": "t", "schema": {"type": "object"}}


def chat(**params) -> generation_pb2.GenerateRequest:
    return chat_request(ChatCompletionRequest(messages=CHAT, **params))


def test_every_chat_parameter_reaches_its_field():
    r = chat(model="m", max_completion_tokens=7, temperature=0.5, top_p=0.9, stop="x", seed=3,
             presence_penalty=0.1, frequency_penalty=-0.2, n=2, top_k=5, min_p=0.1, repetition_penalty=1.1,
             ignore_eos=True, min_tokens=2, stop_token_ids=[9], logprobs=True, top_logprobs=4,
             response_format={"type": "json_schema", "json_schema": SCHEMA})  # fmt: skip
    assert [(m.role, m.content) for m in r.chat.messages] == [("system", "be brief"), ("user", "hi")]
    assert (r.model, r.max_tokens, list(r.stop), list(r.stop_token_ids)) == ("m", 7, ["x"], [9])
    s = r.sampling
    assert s.temperature == pytest.approx(0.5) and s.top_p == pytest.approx(0.9) and s.seed == 3
    assert s.presence_penalty == pytest.approx(0.1) and s.frequency_penalty == pytest.approx(-0.2)
    assert (s.top_k, s.logprobs, s.top_logprobs, r.n, r.min_tokens, r.ignore_eos) == (5, True, 4, 2, 2, True)
    assert s.min_p == pytest.approx(0.1) and s.repetition_penalty == pytest.approx(1.1)
    assert json.loads(r.response_format.json_schema) == {"type": "object"}
    unset = chat()
    assert not unset.sampling.HasField("temperature") and not unset.HasField("max_tokens")
    assert not unset.HasField("response_format") and unset.n == 0
    assert chat(response_format={"type": "json_object"}).response_format.json_object


def test_completions_prompts_and_integer_logprobs():
    [text] = completion_requests(CompletionRequest(prompt="abc", logprobs=2))
    assert text.text == "abc" and text.sampling.logprobs and text.sampling.top_logprobs == 2
    [ids] = completion_requests(CompletionRequest(prompt=[1, 2, 3]))
    assert list(ids.token_ids.ids) == [1, 2, 3] and not ids.sampling.logprobs
    several = completion_requests(CompletionRequest(prompt=[[1, 2], [3]]))
    assert [list(r.token_ids.ids) for r in several] == [[1, 2], [3]]
    assert len({r.request_id for r in several}) == 2


@pytest.mark.parametrize(
    "neutral",
    [{"tools": []}, {"tool_choice": None}, {"functions": []}, {"store": False}, {"modalities": ["text"]}],
)
def test_a_neutral_value_of_a_refused_parameter_passes(neutral):
    chat(**neutral)


@pytest.mark.parametrize(
    ("params", "name"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ],
)
def test_a_refused_value_is_a_400_naming_it(params, name):
    with pytest.raises(HttpError) as err:
        chat(**params)
    assert err.value.status == 400 and err.value.param == name and name in err.value.message


def test_logit_bias_maps_token_ids_written_as_keys_onto_the_sampling_params():
    assert dict(chat(logit_bias={"5": 100, "12": -2.5}).sampling.logit_bias) == {5: 100.0, 12: -2.5}
    [r] = completion_requests(CompletionRequest(prompt="a", logit_bias={"7": -100}))
    assert dict(r.sampling.logit_bias) == {7: -100.0} and not chat().sampling.logit_bias
    with pytest.raises(HttpError) as err:
        chat(logit_bias={"4294967296": 1})
    assert err.value.status == 400 and err.value.param == "logit_bias"
    with pytest.raises(ValidationError):  # one id, one key: "012" would collapse onto "12"
        ChatCompletionRequest(messages=CHAT, logit_bias={"012": 1})


def test_completions_take_max_completion_tokens_as_guidellm_sends_it():
    # guidellm 0.2.1 sends max_tokens and max_completion_tokens, equal, with stop: null
    [r] = completion_requests(CompletionRequest(prompt="a", max_tokens=5, max_completion_tokens=5, stop=None))
    assert r.max_tokens == 5 and not r.stop
    [r] = completion_requests(CompletionRequest(prompt="a", max_completion_tokens=3))
    assert r.max_tokens == 3
    with pytest.raises(HttpError) as err:
        completion_requests(CompletionRequest(prompt="a", max_tokens=3, max_completion_tokens=4))
    assert err.value.status == 400 and err.value.param == "max_completion_tokens"


def test_completions_refuse_best_of_and_suffix_but_take_their_neutral_values():
    completion_requests(CompletionRequest(prompt="a", best_of=1))
    for params, name in (({"best_of": 3}, "best_of"), ({"suffix": "z"}, "suffix")):
        with pytest.raises(HttpError) as err:
            completion_requests(CompletionRequest(prompt="a", **params))
        assert err.value.param == name


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 502),
    ],
)
def test_grpc_codes_map_to_openai_statuses(code, status):
    error = errors.from_exception(
        WorkerCallFailed(code, 'worker "n": min_tokens is not supported (request id 1)')
    )
    assert error.status == status
    assert error.param == ("min_tokens" if status == 400 else None)  # never the worker id "n"
    response = errors.response(error)
    assert response.status_code == status and (response.headers.get("retry-after") == "1") == (status == 429)
    body = json.loads(response.body)
    assert set(body["error"]) == {"message", "type", "param", "code"}


def chunk(
    text: str, token: int, *, index: int = 0, finish: int = 0, usage: tuple[int, int, int] | None = None
):
    c = generation_pb2.GenerateChunk(
        request_id="r", text=text, token_ids=[token], logprobs=[-0.5], index=index
    )
    c.finish_reason = finish
    if usage is not None:
        c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.cached_prompt_tokens = usage
    return c


def test_chat_stream_rendering_role_first_finish_last_usage_apart():
    r = Rendering(True, "abc", "m", logprobs=True, include_usage=True)
    first = r.add(0, chunk("He", 5))
    assert first["delta"] == {"content": "He", "role": "assistant"} and first["finish_reason"] is None
    assert first["logprobs"]["content"][0]["token"] == "He"
    assert r.add(0, chunk("", 6)) is not None  # logprobs asked for: every token is reported
    last = r.add(0, chunk("", 7, finish=generation_pb2.FINISH_REASON_LENGTH, usage=(4, 3, 2)))
    assert last["delta"] == {} and last["finish_reason"] == "length"
    event = json.loads(r.event(last)[6:])
    assert (
        event["object"] == "chat.completion.chunk"
        and event["id"] == "chatcmpl-abc"
        and event["usage"] is None
    )
    closing = r.closing_events().split("\n\n")
    usage = json.loads(closing[0][6:])
    assert usage["choices"] == [] and closing[1] == "data: [DONE]"
    assert usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip


def test_logprobs_name_tokens_and_alternatives_by_the_workers_texts_and_fall_back_to_ids():
    named = generation_pb2.GenerateChunk(
        request_id="r", text="Hello", token_ids=[5, 6], logprobs=[-0.5, -0.25], tokens=["Hel", "lo"]
    )
    named.top_logprobs.add(token_ids=[5, 9], logprobs=[-0.5, -1.0], tokens=["Hel", "<|im_end|>"])
    named.top_logprobs.add(token_ids=[6, 9], logprobs=[-0.25, -3.0], tokens=["lo", "<|im_end|>"])
    chat = Rendering(True, "a", "m", logprobs=True, include_usage=False).add(0, named)
    [hel, lo] = chat["logprobs"]["content"]
    assert (hel["token"], hel["bytes"], lo["token"]) == ("Hel", [72, 101, 108], "lo")
    assert [t["token"] for t in hel["top_logprobs"]] == ["Hel", "<|im_end|>"]
    text = Rendering(False, "b", "m", logprobs=True, include_usage=False).add(0, named)
    assert text["logprobs"]["tokens"] == ["Hel", "lo"] and text["logprobs"]["text_offset"] == [0, 3]
    assert text["logprobs"]["top_logprobs"] == [
        {"Hel": -0.5, "<|im_end|>": -1.0},
        {"lo": -0.25, "<|im_end|>": -3.0},
    ]
    del named.tokens[:]  # a worker that sends no names
    for top in named.top_logprobs:
        del top.tokens[:]
    old = Rendering(False, "c", "m", logprobs=True, include_usage=False).add(0, named)
    assert old["logprobs"]["tokens"] == ["token_id:5", "token_id:6"]
    assert old["logprobs"]["top_logprobs"][0] == {"token_id:5": -0.5, "token_id:9": -1.0}


def test_echo_asks_for_the_prompt_and_with_logprobs_for_its_logprobs():
    [plain] = completion_requests(CompletionRequest(prompt="a", echo=True))
    assert plain.echo and not plain.sampling.HasField("prompt_logprobs")
    [scored] = completion_requests(CompletionRequest(prompt="a", echo=True, logprobs=1))
    assert scored.echo and scored.sampling.prompt_logprobs == 1 and scored.sampling.top_logprobs == 1


def test_an_echoed_prompt_comes_first_in_the_text_and_the_logprobs_its_first_token_without_one():
    first = generation_pb2.GenerateChunk(
        request_id="r", text=" x", token_ids=[9], logprobs=[-0.5], tokens=[" x"]
    )
    first.top_logprobs.add(token_ids=[9], logprobs=[-0.5], tokens=[" x"])
    first.prompt.text, first.prompt.tokens[:] = "Hi there", ["Hi", " there"]
    first.prompt.token_ids[:], first.prompt.logprobs[:] = [5, 6], [-2.0]
    first.prompt.top_logprobs.add(token_ids=[7], logprobs=[-1.0], tokens=[" here"])
    r = Rendering(False, "e", "m", logprobs=True, include_usage=False)
    streamed = r.add(0, first)
    assert streamed is not None and streamed["text"] == "Hi there x"
    assert streamed["logprobs"] == {
        "tokens": ["Hi", " there", " x"],
        "token_logprobs": [None, -2.0, -0.5],
        "top_logprobs": [None, {" here": -1.0}, {" x": -0.5}],
        "text_offset": [0, 2, 8],
    }
    whole = r.whole()["choices"][0]
    assert whole["text"] == "Hi there x" and whole["logprobs"]["tokens"] == ["Hi", " there", " x"]


def test_text_offsets_are_the_same_however_the_chunks_were_merged():
    names = ["\ufffd", "\ufffd", "\ufffd", "\ufffd", " x"]  # an emoji's four byte tokens, then a word
    merged = Rendering(False, "m", "m", logprobs=True, include_usage=False)
    one = generation_pb2.GenerateChunk(request_id="r", text="🙂 x", token_ids=range(5), logprobs=[-1.0] * 5)
    one.tokens[:] = names
    offsets = merged.add(0, one)["logprobs"]["text_offset"]
    apart = Rendering(False, "a", "m", logprobs=True, include_usage=False)
    texts = ["", "", "", "🙂", " x"]
    singles = [
        generation_pb2.GenerateChunk(request_id="r", text=t, token_ids=[i], logprobs=[-1.0], tokens=[n])
        for i, (t, n) in enumerate(zip(texts, names, strict=True))
    ]
    assert (
        offsets == [o for c in singles for o in apart.add(0, c)["logprobs"]["text_offset"]] == [0, 1, 2, 3, 4]
    )


def test_an_echo_a_worker_did_not_answer_is_a_502_naming_echo():
    r = Rendering(False, "e", "m", logprobs=True, include_usage=False, echo=True)
    with pytest.raises(HttpError) as err:
        r.add(0, chunk("x", 5))  # an older worker drops the echo field and answers without the prompt
    assert (
        err.value.status == 502
        and err.value.param == "echo"
        and "did not echo the prompt" in err.value.message
    )


def test_whole_completions_with_two_choices():
    r = Rendering(False, "x", "m", logprobs=False, include_usage=False)
    r.add(1, chunk("b", 2, index=1, finish=generation_pb2.FINISH_REASON_STOP, usage=(3, 1, 0)))
    r.add(0, chunk("a", 1, finish=generation_pb2.FINISH_REASON_STOP, usage=(3, 1, 0)))
    whole = r.whole()
    assert whole["object"] == "text_completion" and [c["text"] for c in whole["choices"]] == ["a", "b"]
    assert whole["usage"]["prompt_tokens"] == 3 and whole["usage"]["completion_tokens"] == 2
