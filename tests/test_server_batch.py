"""``mlx_lm.server`` with a drafter batches concurrent requests: a real
server process on loopback, with the bundled tiny models."""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_integration import ASSISTANT, DSPARK, Server, streamed_text, text_of


def request(i):
    """A mix of endpoints, streaming, budgets and per-request drafts."""
    rng = random.Random(i)
    words = " ".join(f"w{rng.randrange(5, 500)}" for _ in range(rng.randrange(1, 12)))
    body = {"max_tokens": rng.randrange(1, 60)}
    if i % 3:
        body["num_draft_tokens"] = rng.randrange(1, 5)
    if i % 2:
        endpoint, body["messages"] = "/v1/chat/completions", [
            {"role": "user", "content": words}
        ]
    else:
        endpoint, body["prompt"] = "/v1/completions", words
    if i % 4 == 1:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return endpoint, body


def post(server, endpoint, body):
    # mlx-lm's HTTP server listens with socketserver's backlog of 5: with
    # more clients connecting at once, this machine resets some connections
    # before the request is read (the stock server too). Such a request
    # was never served, so it is sent again.
    for attempt in range(5):
        try:
            return server.post(endpoint, body)
        except ConnectionResetError:
            if attempt == 4:
                raise


def answer(server, endpoint, body):
    response = post(server, endpoint, body)
    if body.get("stream"):
        return streamed_text(response), response[-1]["usage"]
    return text_of(response), response["usage"]


def served(server, requests):
    """Each request's ``answer``, all of them sent at once."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: answer(server, *r), requests))


@pytest.fixture(scope="module")
def three_servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch-servers")
    servers = (
        Server(tmp, "--draft-model", DSPARK),
        Server(tmp, "--draft-model", DSPARK, "--draft-batch-policy", "off"),
        Server(tmp),
    )
    yield servers
    for server in servers:
        server.stop()


@pytest.mark.parametrize("clients", [8, 16])
def test_concurrent_clients_get_the_stock_servers_responses(three_servers, clients):
    """Every response of the batched speculative server, and of the
    one-at-a-time one, equals the stock server's (no drafter), with each
    request's own speculative statistics (greedy requests, which a drafter
    loaded without a scheduler paces under ``cost`` one at a time too)."""
    batched, single, stock = three_servers
    requests = [request(clients * 100 + i) for i in range(clients)]
    expected = [answer(stock, *r)[0] for r in requests]
    for server, policy in ((batched, "cost"), (single, "cost")):
        got = served(server, requests)
        assert [text for text, _ in got] == expected
        for (_, body), (_, usage) in zip(requests, got):
            stats = usage["speculative"]
            assert stats["scheduler"] == policy
            assert stats["rounds"] >= (body["max_tokens"] > 1)
            assert sum(1 for r in stats["acceptance_by_position"] if r is not None) <= (
                body.get("num_draft_tokens", 4)
            )


def log_probabilities(response):
    return [
        (entry["id"], entry["logprob"], [(t["id"], t["logprob"]) for t in entry.get("top_logprobs", [])])
        for entry in response["choices"][0]["logprobs"]["content"]
    ]


def test_concurrent_clients_get_the_stock_servers_log_probabilities(three_servers):
    """The batched server hands each token's log-probability, and the top
    ones, as the stock server does: without ``top_logprobs`` each token's
    own, which it reads with the round (``ServerBatchGenerator``); with them
    (mlx-lm then reports the top one as the token's), the ``[V]`` array's."""
    batched, _, stock = three_servers
    requests = [
        {"prompt": f"w{7 * i + 5} w{11 * i + 9}", "max_tokens": 10 + i, "logprobs": True,
         "top_logprobs": 3 * (i % 2)}
        for i in range(6)
    ]
    expected = [log_probabilities(stock.post("/v1/completions", r)) for r in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(lambda r: log_probabilities(post(batched, "/v1/completions", r)), requests))
    for want, have in zip(expected, got):
        assert [(i, [t for t, _ in top]) for i, _, top in have] == [
            (i, [t for t, _ in top]) for i, _, top in want
        ]
        values = lambda entries: [v for _, v, top in entries for v in [v] + [p for _, p in top]]  # noqa: E731
        assert values(have) == pytest.approx(values(want), abs=1e-4)


def test_a_request_served_alone_is_paced_when_sampling_without_a_seed(three_servers):
    """One request at a time (``--draft-batch-policy off``, or a request
    the server cannot batch): a sampled request without a seed samples a
    new text each time anyway, and is paced by ``cost`` as a greedy one is;
    with a seed it drafts every round (``fixed``), and the seed gives one
    text."""
    _, single, _ = three_servers
    body = {"prompt": "w5 w9 w12", "max_tokens": 24, "temperature": 0.9}
    unseeded = single.post("/v1/completions", body)["usage"]["speculative"]
    assert (unseeded["acceptance_rule"], unseeded["scheduler"]) == ("rejection", "cost")
    seeded = [single.post("/v1/completions", {**body, "seed": 7}) for _ in range(2)]
    assert seeded[0]["usage"]["speculative"]["scheduler"] == "fixed"
    assert text_of(seeded[0]) == text_of(seeded[1])


@pytest.mark.parametrize(
    "options, seed, paced",
    [({}, None, "cost"), ({}, 0, None), ({"scheduler": "fixed"}, None, None),
     ({"confidence_threshold": 0.5}, None, None)],
)
def test_only_a_request_without_a_seed_or_a_chosen_scheduler_is_paced_alone(
    monkeypatch, options, seed, paced
):
    """What ``serve_single`` asks the engine for: ``cost`` for a request
    without a seed where the server was given no scheduler or threshold
    (``--draft-scheduler``, ``--draft-confidence-threshold``), nothing
    otherwise (the drafter's own, with its threshold, or ``fixed`` for a
    seeded sampled request); and nothing once the request is served."""
    from types import SimpleNamespace

    from mlx_dspark.integration import dispatch, server

    monkeypatch.setattr(dispatch, "drafter_options", options)
    monkeypatch.setattr(server, "drafter_options", options)
    seen = []
    request = (None, None, SimpleNamespace(num_draft_tokens=4, seed=seed))
    server.serve_single(lambda *_: seen.append(dispatch.local.scheduler), None, request, None)
    assert seen == [paced] and dispatch.local.scheduler is None


def test_the_batched_server_logs_each_requests_statistics(three_servers):
    batched, _, _ = three_servers
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: answer(batched, *request(i)), range(4)))
    log = batched.log.read_text()
    assert log.count("Speculative decoding: dspark (greedy):") >= 4


@pytest.fixture(scope="module")
def assistant_servers(tmp_path_factory):
    """The assistant fixture's target served with its assistant, and stock."""
    tmp = tmp_path_factory.mktemp("assistant-servers")
    target = ASSISTANT / "target"
    servers = (
        Server(tmp, "--draft-model", ASSISTANT / "assistant", model=target),
        Server(tmp, model=target),
    )
    yield servers
    for server in servers:
        server.stop()


def test_the_assistant_is_served_in_batches(assistant_servers):
    """With the Gemma-4 assistant the server batches concurrent requests
    (the batch policy drafts for them), and every response equals the
    stock server's."""
    batched, stock = assistant_servers
    requests = [request(900 + i) for i in range(8)]
    expected = [answer(stock, *r)[0] for r in requests]
    got = served(batched, requests)
    assert [text for text, _ in got] == expected
    for _, usage in got:
        assert usage["speculative"]["drafter"] == "assistant"
        assert usage["speculative"]["scheduler"] == "cost"
