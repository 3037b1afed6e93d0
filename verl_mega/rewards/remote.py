"""Scores from a service of the team's own, over HTTP (docs/remote-rewards.md): the JSON scoring protocol, and
what every remote reward shares: requests in flight up to a bound, each retried with exponential backoff, the
run stopped after too many failures in a row, and the latency, retry and failure counts for the metrics.

The JSON protocol: POST {url} with `{"rows": [{"data_source", "prompt", "response", "ground_truth",
"extra_info"}, ...]}`, answered by `{"scores": [...]}`, one per row in order: a number, or a dict with a numeric
"score" and extra fields (read as a reward function's dict, `results.read_value`). Anything else (an HTTP error,
a timeout, a body that is not JSON, a wrong count, a score that is not a finite number) fails the request, which
is retried; a request that fails its last retry stops the run naming the URL. No score is ever filled in.

Pure of the trainer: rows in, `Scored` out. Plain stdlib HTTP (urllib) in a thread pool: no client library.
"""
from __future__ import annotations

import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from http.client import HTTPException
from typing import Any, Callable, Sequence, TypeVar

from verl_mega.config.errors import UserError

from .results import Refused, Scored, described, read_value

T = TypeVar("T")
SHOWN_CHARS = 80  # of a reply quoted in a failure


class RequestFailed(Exception):
    """One attempt failed (the service, the network, or a reply the protocol does not allow): it is retried."""


class RemoteRewardError(UserError):
    """The service could not score a batch: the run stops with this line, naming the URL."""


@dataclass
class RemoteStats:
    """Attempts since the last `drain`: each one's seconds, the retries, the failed ones, the judge's answers
    its pattern did not read."""

    latencies: list[float] = field(default_factory=list)
    retries: int = 0
    failures: int = 0
    unparsed: int = 0

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        latencies = self.latencies or [0.0]
        return {f"{prefix}remote_latency_mean_s": sum(latencies) / len(latencies),
                f"{prefix}remote_latency_max_s": max(latencies), f"{prefix}remote_retries": self.retries,
                f"{prefix}remote_failures": self.failures, f"{prefix}remote_unparsed": self.unparsed}

    @staticmethod
    def merged(parts: Sequence[RemoteStats]) -> RemoteStats:
        return RemoteStats([seconds for part in parts for seconds in part.latencies], sum(p.retries for p in parts),
                           sum(p.failures for p in parts), sum(p.unparsed for p in parts))


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


@dataclass(frozen=True)
class ClientKeys:
    """The config keys a client's failures name (the remote reward's, or another service's)."""

    url: str = "reward.remote.url"
    timeout: str = "reward.remote.timeout_s"
    retries: str = "reward.remote.max_retries"
    in_a_row: str = "reward.remote.max_consecutive_failures"


def post_json(url: str, body: Any, timeout_s: float, headers: dict[str, str],
              timeout_key: str = ClientKeys.timeout) -> Any:
    """The JSON reply to `body` POSTed to `url`; RequestFailed for an HTTP error, a network failure, a timeout or
    a body that is not JSON (NaN and Infinity included, which Python's json would otherwise read)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            raw = reply.read()
    except urllib.error.HTTPError as err:
        raise RequestFailed(f"HTTP {err.code} {err.reason}") from None
    except urllib.error.URLError as err:
        raise RequestFailed(f"{err.reason}") from None
    except TimeoutError:
        raise RequestFailed(f"no reply within {timeout_key}={timeout_s:g}") from None
    except (OSError, HTTPException) as err:
        raise RequestFailed(f"{type(err).__name__}: {err}") from None
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as err:
        shown = raw[:SHOWN_CHARS].decode(errors="replace")
        raise RequestFailed(f"the reply is not JSON ({err}): {shown!r}") from None


def auth_headers(api_key_env: str) -> dict[str, str]:
    """`Authorization: Bearer` with the key held by the variable named `api_key_env` ("" : no header)."""
    if not api_key_env:
        return {}
    key = os.environ.get(api_key_env, "")
    if not key:
        raise UserError(f"reward.remote.api_key_env: the environment variable {api_key_env} is not set")
    return {"Authorization": f"Bearer {key}"}


class RemoteClient:
    """Runs requests to `url`: at most `max_concurrency` at once, each retried `max_retries` times after
    `backoff_s`, 2 * backoff_s, ...; the whole run stops (RemoteRewardError) at a request's last failure or at the
    `max_consecutive_failures`-th failed attempt in a row. Counts into `stats` (`drain` hands them over)."""

    def __init__(self, url: str, *, max_concurrency: int, timeout_s: float, max_retries: int, backoff_s: float,
                 max_consecutive_failures: int, api_key_env: str = "", keys: ClientKeys = ClientKeys()):
        self.url, self.max_concurrency, self.timeout_s = url, max_concurrency, timeout_s
        self.max_retries, self.backoff_s, self.max_consecutive_failures = max_retries, backoff_s, \
            max_consecutive_failures
        self.headers, self.keys = auth_headers(api_key_env), keys
        self.stats = RemoteStats()
        self.consecutive_failures = 0  # over the client's life: a success anywhere resets it
        self._lock = threading.Lock()

    def post(self, url: str, body: Any) -> Any:
        return post_json(url, body, self.timeout_s, self.headers, self.keys.timeout)

    def drain(self) -> RemoteStats:
        with self._lock:
            stats, self.stats = self.stats, RemoteStats()
        return stats

    def count_unparsed(self) -> None:
        with self._lock:
            self.stats.unparsed += 1

    def map(self, attempt: Callable[[Any], T], items: Sequence[Any], labels: Sequence[str]) -> list[T]:
        """`attempt(item)` for each item (one request; RequestFailed when it fails), retried, in a pool; the
        results in order. `labels` name the items in the line that stops the run."""
        if not items:
            return []
        stop = threading.Event()  # set at the first fatal failure: the others give up at their next wait
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(items))) as pool:
            futures = [pool.submit(self._retried, attempt, item, label, stop) for item, label in zip(items, labels)]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((future for future in futures if future in done and future.exception()), None)
            if failed is not None:
                stop.set()
                for future in futures:
                    future.cancel()
                raise failed.exception()
        return [future.result() for future in futures]

    def one(self, attempt: Callable[[Any], T], item: Any, label: str) -> T:
        """`attempt(item)`, retried, in the caller's thread (the caller bounds how many run at once)."""
        return self._retried(attempt, item, label, threading.Event())

    def _retried(self, attempt: Callable[[Any], T], item: Any, label: str, stop: threading.Event) -> T | None:
        for number in range(self.max_retries + 1):
            if stop.is_set():
                return None
            start = time.monotonic()
            try:
                result = attempt(item)
            except RequestFailed as err:
                try:
                    self._failed(time.monotonic() - start, number, label, err)
                except RemoteRewardError:
                    stop.set()  # before the pool's next request starts
                    raise
            else:
                with self._lock:
                    self.stats.latencies.append(time.monotonic() - start)
                    self.consecutive_failures = 0
                return result
            stop.wait(self.backoff_s * 2 ** number)
        raise AssertionError("unreachable: the last attempt's failure raises")

    def _failed(self, seconds: float, number: int, label: str, err: RequestFailed) -> None:
        """Count a failed attempt; raise RemoteRewardError when it ends the run."""
        with self._lock:
            self.stats.latencies.append(seconds)
            self.stats.failures += 1
            self.consecutive_failures += 1
            in_a_row = self.consecutive_failures
            last = number == self.max_retries
            if not last:
                self.stats.retries += 1
        if in_a_row >= self.max_consecutive_failures:
            raise RemoteRewardError(f"{self.keys.url} {self.url}: {in_a_row} failed requests in a row "
                                    f"({self.keys.in_a_row}={self.max_consecutive_failures}); "
                                    f"the last, {label}: {err}")
        if last:
            raise RemoteRewardError(f"{self.keys.url} {self.url}: {label} failed {number + 1} times "
                                    f"({self.keys.retries}={self.max_retries}); the last: {err}")


def plain(value: Any) -> Any:
    """`value` as JSON data: arrays as lists, anything else JSON has no type for as its str()."""
    return json.loads(json.dumps(value, default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)))


def json_row(data_source, prompt, response: str, ground_truth, extra_info) -> dict:
    return plain({"data_source": data_source, "prompt": prompt, "response": response, "ground_truth": ground_truth,
                  "extra_info": extra_info})


def read_scores(reply: Any, count: int) -> list[Scored]:
    """The `count` scores of a JSON reply; RequestFailed for anything the protocol does not allow."""
    scores = reply.get("scores") if isinstance(reply, dict) else None
    if not isinstance(scores, list):
        raise RequestFailed(f"the reply has no \"scores\" list: {described(reply)}")
    if len(scores) != count:
        raise RequestFailed(f"the reply has {len(scores)} scores for {count} rows")
    return [read_score(value, row) for row, value in enumerate(scores)]


def read_score(value: Any, row: int) -> Scored:
    verdict = read_value(value)
    if isinstance(verdict, Refused):
        raise RequestFailed(f"score {row} {verdict.problem.removeprefix('returned ')}")
    if not math.isfinite(verdict.score):
        raise RequestFailed(f"score {row} is {verdict.score}, not a finite number")
    return verdict


def score_json(client: RemoteClient, rows: Sequence[dict], batch_size: int) -> list[Scored]:
    """One score per row (`json_row`s), `batch_size` rows a request."""
    starts = range(0, len(rows), batch_size)
    batches = [list(rows[start:start + batch_size]) for start in starts]
    labels = [f"rows {start}-{start + len(batch) - 1}" for start, batch in zip(starts, batches)]

    def attempt(batch: list[dict]) -> list[Scored]:
        return read_scores(client.post(client.url, {"rows": batch}), len(batch))

    return [scored for batch in client.map(attempt, batches, labels) for scored in batch]
