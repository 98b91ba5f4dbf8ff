"""Noticing a client that leaves before its answer is written, for non-streamed requests too (vLLM aborts those as
well): `DisconnectWatch`, an ASGI middleware, watches each POST's connection once its body is read and sets that
request's `client_gone()` event when the client disconnects. The server passes the event on as the backend's
`abort`, so the engine drops the request (waiting, prefilling or decoding) instead of finishing an answer nobody
will read, e.g. after an SDK's timeout, whose retry would otherwise queue behind it.

The event reaches the endpoint's thread through a context variable (the endpoints run in threads that copy the
request's context); threads the server starts itself (streams' and background responses' generations) do not see
it: a stream notices its own disconnect, and a background response outlives its client on purpose.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading

_CLIENT_GONE: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("openm3_client_gone",
                                                                                      default=None)


def client_gone() -> threading.Event | None:
    """The event set when the client of the request being served disconnects (None outside a watched request)."""
    return _CLIENT_GONE.get()


class DisconnectWatch:
    """ASGI middleware: after a POST's body is read, one task reads the connection's further messages (the app's
    own later `receive` calls get them from it in order) and sets the request's `client_gone()` event at
    `http.disconnect`; the task ends with the request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        gone = threading.Event()
        later: asyncio.Queue = asyncio.Queue()
        listener: asyncio.Task | None = None

        async def listen() -> None:
            while True:
                message = await receive()
                later.put_nowait(message)
                if message["type"] == "http.disconnect":
                    gone.set()
                    return

        async def watched_receive():
            nonlocal listener
            if listener is not None:  # the body is read: the listener owns the connection
                if gone.is_set() and later.empty():
                    return {"type": "http.disconnect"}
                return await later.get()
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                listener = asyncio.get_running_loop().create_task(listen())
            return message

        token = _CLIENT_GONE.set(gone)
        try:
            await self.app(scope, watched_receive, send)
        finally:
            _CLIENT_GONE.reset(token)
            if listener is not None:
                listener.cancel()
