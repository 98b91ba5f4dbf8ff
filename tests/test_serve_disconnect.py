"""A streaming client that disconnects before its first token (its request still waits for a place in the batch,
or prefills a long prompt) ends the generation at once: the server reads the stream on its event loop, notices
the disconnect and sets the backend's `abort`. Served by a real uvicorn server on a local port (the test client
cannot disconnect)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from openm3.serve import create_app

from test_serve import NAME, tok  # noqa: F401 - the fixture
from test_serve_background import Unadmitted

uvicorn = pytest.importorskip("uvicorn")


@pytest.fixture
def server(tok):
    backend = Unadmitted(tok.vocab_size)
    config = uvicorn.Config(create_app(backend, tok, model_name=NAME, max_total_tokens=4096), host="127.0.0.1",
                            port=0, log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.started, "uvicorn did not start"
    port = srv.servers[0].sockets[0].getsockname()[1]
    yield backend, port
    srv.should_exit = True
    thread.join(30)


BODIES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", {"prompt": "hi"}),
    "responses": ("/v1/responses", {"input": "hi"}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}),
}


@pytest.mark.parametrize("api", list(BODIES))
def test_a_client_that_disconnects_before_its_first_token_aborts_its_request(server, api):
    backend, port = server
    path, body = BODIES[api]
    data = json.dumps({"model": NAME, "stream": True, **body}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        assert backend.waiting.wait(10)
        time.sleep(0.2)
        assert not backend.aborted.is_set()  # the client is still there: the request waits
    assert backend.aborted.wait(5), "the request went on after its client left"
