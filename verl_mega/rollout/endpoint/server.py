"""The rollout endpoint's HTTP server: the standard library's threading server on a local port, JSON in and out.

A thread per connection reads a request (a body of MAX_BODY_BYTES at most), hands it to the app, and writes its
answer; the thread then waits, off the engine, while the app's generation round runs. Every error is OpenAI's
JSON error body; nothing the client sends reaches a traceback.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from .openai_format import EndpointError

MAX_BODY_BYTES = 16 * 2**20
POLL_S = 0.02
DRAIN_BYTES = 64 * 2**20  # a body too large is read and dropped up to this size, beyond it the connection closed

# (method, path, parsed JSON body or None) -> (status, JSON answer); raises EndpointError for a refusal.
App = Callable[[str, str, object], tuple[int, dict]]
# Told the code of each refusal the server makes itself (before the app sees the request).
Refused = Callable[[str], None]


class EndpointServer:
    """Serves `app` on `host`:`port` (0: a free port) from `start()` to `close()`."""

    def __init__(self, app: App, refused: Refused, host: str = "127.0.0.1", port: int = 0):
        handler = type("Handler", (_Handler,), {"app": staticmethod(app), "refused": staticmethod(refused)})
        self.httpd = _Server((host, port), handler)
        # The loop looks for `close` every POLL_S: the rollout waits that long for the server to stop.
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(POLL_S,), name="rollout-endpoint",
                                       daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "EndpointServer":
        self.thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    def __enter__(self) -> "EndpointServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a connection an agent leaves open never holds the process
    request_queue_size = 1024  # the listen backlog: a batch's agents connect at once (socketserver's default: 5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the openai client reuses its connections
    # TCP_NODELAY: an answer goes out as two writes (headers, body); with Nagle's algorithm on a kept-alive
    # connection the body waits for the client's delayed ACK of the headers, 40 ms on Linux, per request.
    disable_nagle_algorithm = True
    timeout = 300  # an idle kept-alive connection is closed after this many seconds
    app: App
    refused: Refused

    def do_GET(self) -> None:
        self._serve("GET", None)

    def do_POST(self) -> None:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._refuse(EndpointError(411, "length_required", "a POST needs a Content-Length"))
            return
        if int(length) > MAX_BODY_BYTES:
            if int(length) <= DRAIN_BYTES:  # read so that the client, still sending, gets the answer
                for start in range(0, int(length), 2**20):
                    self.rfile.read(min(2**20, int(length) - start))
            self.close_connection = True  # an unread body would be taken for the next request
            self._refuse(EndpointError(413, "request_too_large", f"the body is {length} bytes; at most "
                                                                 f"{MAX_BODY_BYTES}"))
            return
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw)
        except ValueError as err:
            self._refuse(EndpointError(400, "invalid_json", f"the body is not JSON ({err})"))
            return
        self._serve("POST", body)

    def _refuse(self, error: EndpointError) -> None:
        self.refused(error.code)
        self._answer(error.status, error.body())

    def _serve(self, method: str, body) -> None:
        try:
            status, answer = self.app(method, self.path, body)
        except EndpointError as err:
            status, answer = err.status, err.body()
        except Exception as err:  # a bug of the endpoint's: the agent gets a 500 and the error, the run goes on
            status, answer = 500, EndpointError(500, "internal_error", f"{type(err).__name__}: {err}").body()
        self._answer(status, answer)

    def _answer(self, status: int, answer: dict) -> None:
        data = json.dumps(answer, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status >= 400:
            self.send_header("x-should-retry", "false")  # the same request gets the same answer
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args) -> None:  # the run's log is the metrics, not one line per request
        pass
