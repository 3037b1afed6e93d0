"""A SandboxFusion service as the code scorer's sandbox (`reward.code.sandbox_url`): each test case's program
goes to the service's `POST {url}/run_code` and comes back as the local sandbox's `ToolResult`, so
`code_tests` judges both the same way.

The protocol is SandboxFusion's, as verl's client speaks it (verl/utils/reward_score/sandbox_fusion/utils.py):
the request `{"code", "language": "python", "stdin", "compile_timeout", "run_timeout", "memory_limit_MB",
"files": {}, "fetch_files": []}`; the reply `{"status": "Success" | "Failed" | "SandboxError", "message",
"compile_result", "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "return_code", "stdout",
"stderr", "execution_time"}}` (SandboxFusion's sandbox/server/sandbox_api.py: a run `Error` is the service's,
reported as `SandboxError`). The answer's doing fails its case: a run past the time limit (`timeout`), a
non-zero exit (`raised`), more stdout than `max_output_chars` (`output_truncated`). The service's own failure
(HTTP error, no connection, no reply in time, `SandboxError`, a run `Error`, a reply that is not this format)
fails the request, which is retried with backoff; the last failure stops the run naming the URL. No outcome
is ever invented.
"""
from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from verl_mega.config.schema import RewardCodeConfig
from verl_mega.tools.results import ToolResult, failure, success

from .remote import ClientKeys, RemoteClient, RequestFailed
from .results import described

API_SLACK_S = 10.0  # the request's time beyond compiling and running, as verl's client allows
KEYS = ClientKeys(url="reward.code.sandbox_url", timeout="2 * reward.code.test_timeout_s + 10",
                  retries="reward.code.sandbox_retries", in_a_row="reward.code.sandbox_retries")


class SandboxFusion:
    """Runs programs on the service at `config.sandbox_url` under `config`'s limits, as PythonSandbox.run does
    locally; the caller's threads bound how many requests are in flight."""

    def __init__(self, config: RewardCodeConfig):
        self.config = config
        self.endpoint = config.sandbox_url.rstrip("/") + "/run_code"
        # Each request fails or succeeds on its own: only its retries stop the run, never others' failures.
        self.client = RemoteClient(config.sandbox_url, max_concurrency=1,
                                   timeout_s=2 * config.test_timeout_s + API_SLACK_S,
                                   max_retries=config.sandbox_retries, backoff_s=config.sandbox_backoff_s,
                                   max_consecutive_failures=1 << 62, keys=KEYS)

    def run(self, code: str, stdin: str = "", with_stderr: bool = False) -> ToolResult:
        """The result of `code` reading `stdin` (stdout only: SandboxFusion keeps stderr apart).
        RemoteRewardError when the service fails the request past its retries."""
        if with_stderr:
            raise ValueError("SandboxFusion returns stdout and stderr apart: run with with_stderr=False")
        body = {"code": code, "language": "python", "stdin": stdin, "compile_timeout": self.config.test_timeout_s,
                "run_timeout": self.config.test_timeout_s, "memory_limit_MB": self.config.memory_mb,
                "files": {}, "fetch_files": []}
        result = self.client.one(lambda request: self.read_reply(self.client.post(self.endpoint, request)), body,
                                 "a test case's run")
        self.client.drain()  # the latency counts are not reported here: kept from growing over the run
        return result

    def read_reply(self, reply: Any) -> ToolResult:
        """The run a reply reports; RequestFailed for a reply that is the service's failure or not its format."""
        if not isinstance(reply, dict) or reply.get("status") not in ("Success", "Failed", "SandboxError"):
            raise RequestFailed(f"the reply is not SandboxFusion's: {described(reply)}")
        if reply["status"] == "SandboxError":
            raise RequestFailed(f"SandboxError: {str(reply.get('message'))[:200]}")
        run, seconds = reply.get("run_result"), 0.0
        if not isinstance(run, dict):  # python has no compile step: every run has a run_result
            raise RequestFailed(f"the reply has no run_result: {described(reply)}")
        stdout, status, code = run.get("stdout") or "", run.get("status"), run.get("return_code")
        if not isinstance(stdout, str) or status not in ("Finished", "TimeLimitExceeded"):
            raise RequestFailed(f"the reply's run_result is not SandboxFusion's: {described(run)}")
        if isinstance(run.get("execution_time"), (int, float)):
            seconds = float(run["execution_time"])
        limit = self.config.max_output_chars
        if len(stdout) > limit:
            return ToolResult(text=stdout[:limit], ok=True, error="output_truncated", seconds=seconds)
        if status == "TimeLimitExceeded":
            return failure("timeout", stdout, seconds)
        if code != 0:
            return failure("raised", stdout, seconds)
        return success(stdout, limit, seconds)


def config_problems(code: RewardCodeConfig, reward_timeout_s: float) -> list[str]:
    """Why `reward.code.sandbox_url` cannot serve this run, one line each ("" is the local sandbox): not an
    http(s) address; or reward.timeout_s (the scoring worker's limit per answer) shorter than the retries that
    find a service down, which would score the answers 0 instead of stopping the run."""
    if not code.sandbox_url:
        return []
    parts = urlsplit(code.sandbox_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return [f"reward.code.sandbox_url {code.sandbox_url!r} is not an http:// or https:// address of a "
                "SandboxFusion service"]
    retrying_s = code.sandbox_backoff_s * (2 ** code.sandbox_retries - 1)
    if 0 < reward_timeout_s <= retrying_s:
        return [f"reward.timeout_s={reward_timeout_s:g} is not above the {retrying_s:g} s of retries "
                f"(reward.code.sandbox_backoff_s={code.sandbox_backoff_s:g}, reward.code.sandbox_retries="
                f"{code.sandbox_retries}) that tell reward.code.sandbox_url is down: answers would score 0 instead "
                "of the run stopping; raise reward.timeout_s (or 0: no limit)"]
    return []
