"""The /healthz endpoint: JSON status and step, 404 elsewhere, port freed on close."""
import json
import socket
import urllib.error
import urllib.request

import pytest

from verl_mega.trainer.health import HealthServer


def get(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return response.status, response.headers["Content-Type"], json.loads(response.read())


@pytest.fixture
def server():
    health = HealthServer(0, host="127.0.0.1")
    yield health
    health.close()


def test_reports_ready_then_the_status_set(server):
    assert server.port > 0
    assert get(server.port, "/healthz") == (200, "application/json", {"status": "ready", "step": 0})
    server.set("training", 3)
    assert get(server.port, "/healthz") == (200, "application/json", {"status": "training", "step": 3})


def test_other_paths_are_not_found(server):
    with pytest.raises(urllib.error.HTTPError) as err:
        get(server.port, "/metrics")
    assert err.value.code == 404
    assert err.value.headers["Content-Type"] == "application/json"


def test_unknown_status_is_refused(server):
    with pytest.raises(ValueError, match="training"):
        server.set("crashed", 1)


def test_close_frees_the_port():
    health = HealthServer(0, host="127.0.0.1")
    port = health.port
    health.close()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
