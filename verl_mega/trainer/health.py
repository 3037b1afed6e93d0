"""`GET /healthz` -> {"status": "ready"|"training"|"saving", "step": N}: liveness for schedulers and probes.

A stdlib HTTP server on a daemon thread, so it needs no dependency and never keeps a finished job alive.
Rank 0 starts it when `trainer.health_port > 0`, bound to 0.0.0.0 so that probes from other hosts (a
Kubernetes kubelet, a Slurm health check) reach it; port 0 takes a free port (tests).
"""
from __future__ import annotations

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HEALTH_PATH = "/healthz"
STATUSES = ("ready", "training", "saving")


class HealthServer:
    def __init__(self, port: int, host: str = "0.0.0.0"):
        self._lock = threading.Lock()
        self._state = {"status": "ready", "step": 0}
        self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="health-server", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound port (the one the OS chose when constructed with port 0)."""
        return self._server.server_address[1]

    def set(self, status: str, step: int) -> None:
        if status not in STATUSES:
            raise ValueError(f"health status must be one of {', '.join(STATUSES)}, got '{status}'")
        with self._lock:
            self._state = {"status": status, "step": int(step)}

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._state)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _handler_for(health: HealthServer) -> type[BaseHTTPRequestHandler]:
    class HealthHandler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path.split("?", 1)[0] != HEALTH_PATH:
                self._reply(HTTPStatus.NOT_FOUND, {"error": f"not found; the health endpoint is {HEALTH_PATH}"})
                return
            self._reply(HTTPStatus.OK, health.snapshot())

        def _reply(self, code: HTTPStatus, body: dict) -> None:
            payload = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format, *args):  # probes every few seconds would flood the training log
            pass

    return HealthHandler
