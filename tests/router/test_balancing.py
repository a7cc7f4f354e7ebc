"""The balances behind one interface (router/balancing/): least-load and prefix-affinity."""

import pytest

from kvpact.client import AsyncClient
from kvpact.router.balancing import BALANCES, LeastLoad, PrefixAffinity, make_balance, routing_key
from kvpact.router.balancing.prefix_affinity import PREFIX_KEY_CHARS, rank
from kvpact.router.balancing.route import route
from kvpact.v1 import generation_pb2
from tests.router.doubles import WorkerDouble, ready, registry_stub, run_async, running_router, serving_double
from tests.router.test_route import entry, registry

SYSTEM = "You are a meticulous assistant for a shipping company. " * 6  # > PREFIX_KEY_CHARS


def text(prompt: str) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(text=prompt)


def test_both_policies_are_registered_by_their_flag_names():
    assert sorted(BALANCES) == ["least-load", "prefix-affinity"]
    assert isinstance(make_balance("least-load"), LeastLoad)
    assert isinstance(make_balance("prefix-affinity"), PrefixAffinity)


def test_prompts_sharing_a_prefix_go_to_one_worker_and_different_prefixes_spread():
    workers = [entry("a"), entry("b"), entry("c")]
    balance = PrefixAffinity()
    for system in (SYSTEM, "Another long system prompt about astronomy and telescopes. " * 6):
        chosen = {balance.choose(workers, text(f"{system}\nQuestion {i}?")).worker_id for i in range(10)}
        assert len(chosen) == 1
    owners = {balance.choose(workers, text(f"prefix {i} " * 40)).worker_id for i in range(30)}
    assert owners == {"a", "b", "c"}


def test_a_hot_prefix_spills_to_another_worker_once_its_owner_is_over_the_load_bound():
    balance = PrefixAffinity()
    request = text(SYSTEM + "Where is my parcel?")
    owner = balance.choose([entry("a"), entry("b")], request).worker_id
    other = "b" if owner == "a" else "a"
    # owner with 1 in flight: bound = ceil(1.25 x (1 + 1) / 2) = 2, so it may take one more
    assert balance.choose([entry(owner, outstanding=1), entry(other)], request).worker_id == owner
    # with 2 in flight: bound = ceil(1.25 x (2 + 1) / 2) = 2, it is full: the next in rank order gets it
    assert balance.choose([entry(owner, outstanding=2), entry(other)], request).worker_id == other


def test_no_prompt_falls_back_to_least_load():
    workers = [entry("a", outstanding=3), entry("b", outstanding=1)]
    assert PrefixAffinity().choose(workers, generation_pb2.GenerateRequest()).worker_id == "b"


def test_a_new_worker_takes_only_the_keys_it_wins():
    keys = [f"tenant {i} ".encode() * 8 for i in range(40)]
    two = [entry("a"), entry("b")]
    three = [*two, entry("c")]
    moved = [k for k in keys if rank(two, k)[0].worker_id != rank(three, k)[0].worker_id]
    assert moved and all(rank(three, k)[0].worker_id == "c" for k in moved)


def test_the_key_is_the_leading_prompt_for_text_chat_and_token_ids():
    assert (
        routing_key(text(SYSTEM + "A?"))
        == routing_key(text(SYSTEM + "B?"))
        == SYSTEM[:PREFIX_KEY_CHARS].encode()
    )
    chat = generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatPrompt(messages=[generation_pb2.ChatMessage(role="system", content=SYSTEM)])
    )
    longer = generation_pb2.GenerateRequest()
    longer.CopyFrom(chat)
    longer.chat.messages.add(role="user", content="hi")
    assert routing_key(chat) == routing_key(longer) != b""
    ids = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=list(range(100))))
    other = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[*range(64), 7, 7]))
    assert routing_key(ids) == routing_key(other)
    assert routing_key(generation_pb2.GenerateRequest()) == b""


def test_route_uses_the_balance_it_is_given():
    r = registry(entry("a", outstanding=0), entry("b", outstanding=0))
    request = text(SYSTEM)
    expected = PrefixAffinity().choose([entry("a"), entry("b")], request).worker_id
    assert route(r, "tiny", PrefixAffinity(), request).worker_id == expected
    assert route(r, "tiny").worker_id == "a"  # least-load by default


@pytest.mark.parametrize("bad", ["random", ""])
def test_an_unknown_balance_is_a_bad_flag(bad, capsys):
    from kvpact.router.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--balance", bad])
    assert exc.value.code == 2
    assert "--balance: invalid choice" in capsys.readouterr().err


@run_async
async def test_a_router_with_prefix_affinity_sends_a_shared_prefix_to_one_worker():
    async with (
        running_router(balance="prefix-affinity", num_expected_workers=2) as router,
        serving_double(WorkerDouble("a")) as a,
        serving_double(WorkerDouble("b")) as b,
        registry_stub(router) as registry,
        AsyncClient(f"127.0.0.1:{router.port}", timeout=30) as client,
    ):
        for double in (a, b):
            assert (await registry.Register(ready(double.worker_id, double.address))).admitted
        prefixes = [f"System prompt number {i}: " + "be brief and exact. " * 15 for i in range(8)]
        owners = {}
        for prefix in prefixes:
            served = {(await client.complete(f"{prefix}Q{j}?", max_tokens=1)).worker_id for j in range(3)}
            assert len(served) == 1, served  # one after another, nothing in flight: always its owner
            owners[prefix] = served.pop()
        assert set(owners.values()) == {"a", "b"}  # different prefixes spread over both workers
