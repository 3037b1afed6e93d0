"""A SandboxFusion-compatible service for the code-reward tests (`python -m tests.workers.sandbox_fusion_server
[MAX_OUTPUT_CHARS]`): a threaded stdlib HTTP server on a free localhost port, printed as its first stdout line.

POST /run_code runs the request's python `code` on its `stdin` in the project's own PythonSandbox, under the
request's `run_timeout` and `memory_limit_MB`, its stdout read up to MAX_OUTPUT_CHARS (default 1,000,000), and
answers in SandboxFusion's format (`status`, `run_result` with `status`, `return_code`, `stdout`, `stderr`).
POST /control sets `fail_times`: that many requests answered HTTP 503 first. GET /stats: requests seen.
"""
from __future__ import annotations

import json
import math
import sys
import threading

from verl_mega.config.schema import PythonSandboxConfig
from verl_mega.tools.results import ToolResult
from verl_mega.tools.sandbox import PythonSandbox

from .json_service import JsonHandler, serve

MAX_OUTPUT_CHARS = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
STATE = {"fail_times": 0, "requests": 0}
LOCK = threading.Lock()
TIME_LIMITS = ("timeout", "cpu_limit")  # the local sandbox's categories SandboxFusion calls TimeLimitExceeded


def run_code(request: dict) -> dict:
    """SandboxFusion's reply to one /run_code request."""
    if request.get("language") != "python":
        return {"status": "SandboxError", "message": f"this test service runs python, not {request.get('language')}"}
    timeout_s = float(request["run_timeout"])
    limits = PythonSandboxConfig(cpu_seconds=math.ceil(timeout_s) + 1, memory_mb=int(request["memory_limit_MB"]))
    result = PythonSandbox(limits, timeout_s, MAX_OUTPUT_CHARS).run(request["code"], stdin=request["stdin"],
                                                                    with_stderr=False)
    if result.error == "sandbox":
        return {"status": "SandboxError", "message": result.text}
    return {"status": "Success" if result.ok else "Failed", "message": "", "compile_result": None,
            "run_result": run_result(result), "executor_pod_name": None, "files": {}}


def run_result(result: ToolResult) -> dict:
    if result.error in TIME_LIMITS:
        status, code = "TimeLimitExceeded", None
    else:
        status, code = "Finished", 0 if result.ok else 1
    return {"status": status, "execution_time": result.seconds, "return_code": code, "stdout": result.text,
            "stderr": ""}


class Handler(JsonHandler):
    def do_GET(self) -> None:
        with LOCK:
            self.reply(200, json.dumps(STATE).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/control":
            with LOCK:
                STATE.update(fail_times=body.get("fail_times", 0), requests=0)
            return self.reply(200, json.dumps({}).encode())
        if self.path != "/run_code":
            return self.reply(404, json.dumps({"detail": "Not Found"}).encode())
        with LOCK:
            STATE["requests"] += 1
            failing = STATE["fail_times"] > 0
            STATE["fail_times"] -= failing
        if failing:
            return self.reply(503, json.dumps({"detail": "service unavailable"}).encode())
        self.reply(200, json.dumps(run_code(body)).encode())


if __name__ == "__main__":
    serve(Handler)
