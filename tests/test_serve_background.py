"""Background responses (OpenAI's Responses API, `background: true`): answered at once as "queued" (or, streamed,
with their events, which `GET ?stream=true` replays), generated in a thread, read back with GET, stopped with
`POST /v1/responses/{id}/cancel`; what cannot work is a 400 naming the field, and a response a stopped server left
unfinished reads as failed."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from openm3.data.tokenizer import EOS
from openm3.serve import create_app
from openm3.serve.response_store import ResponseStore

from test_serve import NAME, Scripted, named_events, tok  # noqa: F401 - the fixture


class Gated:
    """A backend that writes `text`'s tokens one at a time, each only once the test lets it (`step`), so a
    response can be caught queued, in progress and cancelled; `fail` makes it raise instead."""

    def __init__(self, tokens: list[int], vocab_size: int, fail: str | None = None):
        self.tokens, self.vocab_size, self.fail = tokens, vocab_size, fail
        self.allowed = threading.Semaphore(0)
        self.started = threading.Event()

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.allowed.release()

    def __call__(self, prompt, *, max_new_tokens, sampling, stop_tokens, seed, on_token):
        self.started.set()
        if self.fail:
            raise RuntimeError(self.fail)
        for t in self.tokens[:max_new_tokens]:
            assert self.allowed.acquire(timeout=30), "the test never let the backend go on"
            on_token(t)
            if t in stop_tokens:
                return "stop"
        return "length"


def poll(client, rid: str, until=lambda s: s not in ("queued", "in_progress"), timeout: float = 30.0) -> dict:
    """GET the response until `until(status)` holds."""
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/v1/responses/{rid}").json()
        if until(body["status"]) or time.monotonic() > deadline:
            return body
        time.sleep(0.01)


def make(tok, backend, **kw):
    return TestClient(create_app(backend, tok, model_name=NAME, max_total_tokens=4096, **kw))


def test_a_background_response_is_queued_then_read_back_equal_to_the_plain_one(tok):
    answer = "Hello there" + EOS
    plain = make(tok, Scripted(tok.encode(answer), tok.vocab_size)).post("/v1/responses", json={
        "model": NAME, "input": "hi"}).json()
    backend = Gated(tok.encode(answer), tok.vocab_size)
    client = make(tok, backend)
    first = client.post("/v1/responses", json={"model": NAME, "input": "hi", "background": True})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["status"] == "queued" and body["background"] is True and body["output"] == []
    assert backend.started.wait(10)
    assert client.get(f"/v1/responses/{body['id']}").json()["status"] == "queued"  # no token yet
    backend.step(1)
    assert poll(client, body["id"], lambda s: s == "in_progress")["status"] == "in_progress"
    r = client.post("/v1/responses", json={"model": NAME, "input": "more", "previous_response_id": body["id"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert "has not finished" in r.json()["error"]["message"]
    backend.step(len(tok.encode(answer)) - 1)
    done = poll(client, body["id"])
    assert done["status"] == "completed" and done["id"] == body["id"]
    assert done["output"][0]["content"][0]["text"] == plain["output"][0]["content"][0]["text"] == "Hello there"
    assert done["usage"] == plain["usage"]
    again = client.post(f"/v1/responses/{body['id']}/cancel")  # finished: returned as it is
    assert again.status_code == 200 and again.json()["status"] == "completed"
    follow = client.post("/v1/responses", json={"model": NAME, "input": "more", "previous_response_id": body["id"],
                                                "background": True}).json()
    backend.step(len(tok.encode(answer)))
    assert poll(client, follow["id"])["status"] == "completed"
    items = client.get(f"/v1/responses/{follow['id']}/input_items").json()["data"]
    assert [i.get("role") for i in items] == ["user", "assistant", "user"]


def test_cancel_stops_a_background_response_and_keeps_what_it_wrote(tok):
    backend = Gated(tok.encode("one two three four five six" + EOS), tok.vocab_size)
    client = make(tok, backend)
    rid = client.post("/v1/responses", json={"model": NAME, "input": "count", "background": True}).json()["id"]
    backend.step(2)
    assert poll(client, rid, lambda s: s == "in_progress")["status"] == "in_progress"
    threading.Timer(0.2, backend.step).start()  # the next token, after the cancel: it finds the request cancelled
    r = client.post(f"/v1/responses/{rid}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
    stored = poll(client, rid)
    assert stored["status"] == "cancelled" and stored["incomplete_details"] is None
    text = stored["output"][0]["content"][0]["text"]
    assert stored["output"][0]["status"] == "incomplete"  # the message was cut
    assert text and "one two three four five six".startswith(text) and text != "one two three four five six"
    assert client.post(f"/v1/responses/{rid}/cancel").json() == stored  # idempotent


def test_a_background_response_that_fails_is_stored_as_failed(tok):
    client = make(tok, Gated([], tok.vocab_size, fail="the cache is full"))
    rid = client.post("/v1/responses", json={"model": NAME, "input": "x", "background": True}).json()["id"]
    body = poll(client, rid)
    assert body["status"] == "failed" and body["error"] == {"code": "server_error", "message": "the cache is full"}


def test_deleting_a_background_response_in_flight_stops_it(tok):
    backend = Gated(tok.encode("a b c d" + EOS), tok.vocab_size)
    client = make(tok, backend)
    rid = client.post("/v1/responses", json={"model": NAME, "input": "x", "background": True}).json()["id"]
    assert backend.started.wait(10)
    assert client.delete(f"/v1/responses/{rid}").json()["deleted"] is True
    backend.step(8)
    time.sleep(0.2)  # the worker has ended; it must not store the response again
    assert client.get(f"/v1/responses/{rid}").status_code == 404


def test_background_requests_that_cannot_work_are_400s(tok):
    client = make(tok, Scripted(tok.encode("ok" + EOS), tok.vocab_size))
    r = client.post("/v1/responses", json={"model": NAME, "input": "x", "background": True, "store": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"
    assert "must be stored" in r.json()["error"]["message"]
    rid = client.post("/v1/responses", json={"model": NAME, "input": "x", "background": True}).json()["id"]
    poll(client, rid)
    r = client.get(f"/v1/responses/{rid}", params={"stream": "true"})  # made without stream: nothing to replay
    assert r.status_code == 400 and "made with stream: true" in r.json()["error"]["message"]
    none = make(tok, Scripted(tok.encode("ok" + EOS), tok.vocab_size), stored_responses=0)
    r = none.post("/v1/responses", json={"model": NAME, "input": "x", "background": True})
    assert r.status_code == 400 and "stores no responses" in r.json()["error"]["message"]


def test_only_background_responses_can_be_cancelled(tok):
    client = make(tok, Scripted(tok.encode("ok" + EOS), tok.vocab_size))
    rid = client.post("/v1/responses", json={"model": NAME, "input": "x"}).json()["id"]
    r = client.post(f"/v1/responses/{rid}/cancel")
    assert r.status_code == 400 and "only background responses can be cancelled" in r.json()["error"]["message"]
    assert client.post("/v1/responses/resp_0123/cancel").status_code == 404


def test_a_restart_reads_an_unfinished_background_response_as_failed(tmp_path):
    store = ResponseStore(4, str(tmp_path))
    rid = "resp_" + "a" * 32
    store.put(rid, [{"role": "user", "content": "x"}], {"id": rid, "status": "in_progress", "output": [],
                                                        "background": True, "error": None})
    again = ResponseStore(4, str(tmp_path)).get(rid)
    assert again["status"] == "failed" and "stopped before" in again["error"]["message"]


def test_a_streamed_background_response_replays_and_outlives_its_client(tok):
    """`background` with `stream`: the events come as a plain stream's do; `GET ?stream=true` replays them (from
    after `starting_after`), live while it runs; a client that drops the stream does not stop the generation."""
    answer = "alpha beta gamma" + EOS
    plain = named_events(make(tok, Scripted(tok.encode(answer), tok.vocab_size)).post(
        "/v1/responses", json={"model": NAME, "input": "hi", "stream": True}))
    backend = Gated(tok.encode(answer), tok.vocab_size)
    client = make(tok, backend)
    backend.step(2)
    with client.stream("POST", "/v1/responses", json={"model": NAME, "input": "hi", "stream": True,
                                                      "background": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
    rid = json.loads(first[len("data: "):])["response"]["id"]  # response.created; then the client went away
    assert poll(client, rid, lambda s: s == "in_progress")["status"] == "in_progress"
    backend.step(len(tok.encode(answer)) - 2)
    done = poll(client, rid)
    assert done["status"] == "completed" and done["background"] is True
    assert done["output"][-1]["content"][0]["text"] == "alpha beta gamma"
    events = named_events(client.get(f"/v1/responses/{rid}", params={"stream": "true"}))
    assert [e["type"] for e in events] == [e["type"] for e in plain]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"] == done
    later = named_events(client.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": 3}))
    assert later == events[4:]


def test_cancelling_a_streamed_background_response_ends_its_stream(tok):
    backend = Gated(tok.encode("one two three four five six" + EOS), tok.vocab_size)
    client = make(tok, backend)
    backend.step(2)
    with client.stream("POST", "/v1/responses", json={"model": NAME, "input": "x", "stream": True,
                                                      "background": True}) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    rid = json.loads(first[len("data: "):])["response"]["id"]
    assert poll(client, rid, lambda s: s == "in_progress")["status"] == "in_progress"
    threading.Timer(0.2, backend.step).start()
    assert client.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"
    events = named_events(client.get(f"/v1/responses/{rid}", params={"stream": "true"}))
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "cancelled"
    assert poll(client, rid)["status"] == "cancelled"


class Unadmitted:
    """A concurrent backend whose requests wait for a place in the batch that never frees (as behind long
    requests), ending only when the server sets their `abort` event."""

    concurrent = True
    supports_abort = True

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.waiting, self.aborted = threading.Event(), threading.Event()

    def __call__(self, prompt, *, max_new_tokens, sampling, stop_tokens, seed, on_token, abort=None):
        self.waiting.set()
        if abort is not None and abort.wait(30):
            self.aborted.set()
            return "abort"
        return "length"


def test_cancelling_a_queued_background_response_ends_it_before_it_is_admitted(tok):
    backend = Unadmitted(tok.vocab_size)
    client = make(tok, backend)
    rid = client.post("/v1/responses", json={"model": NAME, "input": "hi", "background": True}).json()["id"]
    assert backend.waiting.wait(10)
    assert client.get(f"/v1/responses/{rid}").json()["status"] == "queued"
    start = time.monotonic()
    r = client.post(f"/v1/responses/{rid}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    assert backend.aborted.wait(5) and time.monotonic() - start < 5  # not the cancel's 10 s wait for a token
    stored = poll(client, rid)
    assert stored["status"] == "cancelled" and stored["output"] == []
