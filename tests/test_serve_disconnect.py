"""A client that disconnects before its first token (its request still waits for a place in the batch, or
prefills a long prompt) ends the generation at once, streamed or not: the server reads a stream on its event loop
and watches a non-streamed request's connection (`DisconnectWatch`), notices the disconnect and sets the backend's
`abort`. Served by a real uvicorn server on a local port (the test client
cannot disconnect)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time

import pytest

from openm3.serve import create_app

from test_serve import NAME, tok  # noqa: F401 - the fixture
from test_serve_background import Unadmitted

uvicorn = pytest.importorskip("uvicorn")


@contextlib.contextmanager
def serving(tok, backend):
    """`backend`'s app on a local port (uvicorn in a thread); yields the port."""
    config = uvicorn.Config(create_app(backend, tok, model_name=NAME, max_total_tokens=4096), host="127.0.0.1",
                            port=0, log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.started, "uvicorn did not start"
    try:
        yield srv.servers[0].sockets[0].getsockname()[1]
    finally:
        srv.should_exit = True
        thread.join(30)


@pytest.fixture
def server(tok):
    backend = Unadmitted(tok.vocab_size)
    with serving(tok, backend) as port:
        yield backend, port


class Slow:
    """A concurrent backend that takes a while before each of its tokens, and notes whether it was aborted."""

    concurrent = True
    supports_abort = True

    def __init__(self, tokens: list[int], vocab_size: int):
        self.tokens, self.vocab_size, self.aborts = tokens, vocab_size, []

    def __call__(self, prompt, *, max_new_tokens, sampling, stop_tokens, seed, on_token, abort=None):
        for t in self.tokens[:max_new_tokens]:
            time.sleep(0.05)
            if abort is not None and abort.is_set():
                self.aborts.append(True)
                return "abort"
            on_token(t)
        self.aborts.append(False)
        return "length"


BODIES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", {"prompt": "hi"}),
    "responses": ("/v1/responses", {"input": "hi"}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}),
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("api", list(BODIES))
def test_a_client_that_disconnects_before_its_first_token_aborts_its_request(server, api, stream):
    backend, port = server
    path, body = BODIES[api]
    data = json.dumps({"model": NAME, "stream": stream, **body}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        assert backend.waiting.wait(10)
        time.sleep(0.2)
        assert not backend.aborted.is_set()  # the client is still there: the request waits
    assert backend.aborted.wait(5), "the request went on after its client left"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_clients_that_stay_get_whole_answers_over_one_kept_alive_connection(tok, stream):
    """No false alarm: the watch ends with each request, so answers on a kept-alive connection all complete."""
    backend = Slow(tok.encode(" one two three four five six"), tok.vocab_size)
    with serving(tok, backend) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for path, body in BODIES.values():
            conn.request("POST", path, json.dumps({"model": NAME, "stream": stream, **body}),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            text = r.read().decode()
            ends = ("data: [DONE]", "event: message_stop", "event: response.incomplete") if stream else ("six",)
            assert r.status == 200 and any(end in text for end in ends), text
        conn.close()
    assert backend.aborts == [False] * len(BODIES)
