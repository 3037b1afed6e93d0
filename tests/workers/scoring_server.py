"""A real scoring service for the remote-reward tests (`python -m tests.workers.scoring_server`): a threaded
stdlib HTTP server on a free localhost port, printed as its first stdout line.

POST /score speaks the JSON protocol (docs/remote-rewards.md); POST /v1/chat/completions speaks OpenAI's chat
completions. POST /control sets how they answer: `mode` ok | dict | garbage | nan | wrong_count | not_number |
http500 (`fail_times` failures with HTTP 503 first, then `mode`), `delay_s` before each answer, `answer` (the
judge's text, `{chars}` replaced by the prompt's length). GET /stats: requests seen, the most in flight at once,
the last Authorization header and the last chat prompt.
"""
from __future__ import annotations

import json
import threading
import time

from .json_service import JsonHandler, serve

STATE = {"mode": "ok", "fail_times": 0, "delay_s": 0.0, "answer": "[[7]]"}
STATS = {"requests": 0, "in_flight": 0, "max_in_flight": 0, "authorization": None, "last_prompt": None}
LOCK = threading.Lock()


def row_score(row: dict) -> float:
    """1 where the response is the ground truth, else the response's length / 100: tells rows apart."""
    return 1.0 if row["response"] == row["ground_truth"] else len(row["response"]) / 100


def scores_body(rows: list[dict], mode: str) -> bytes:
    scores: list = [row_score(row) for row in rows]
    if mode == "dict":
        scores = [{"score": score, "acc": float(score == 1.0), "note": row["data_source"]}
                  for score, row in zip(scores, rows)]
    elif mode == "nan":
        scores[-1] = float("nan")
    elif mode == "wrong_count":
        scores = scores[:-1]
    elif mode == "not_number":
        scores[0] = "high"
    return json.dumps({"scores": scores}).encode()


class Handler(JsonHandler):
    def do_GET(self) -> None:
        with LOCK:
            self.reply(200, json.dumps(STATS).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/control":
            with LOCK:
                STATE.update(body)
                STATS.update(requests=0, max_in_flight=0, authorization=None, last_prompt=None)
            return self.reply(200, b"{}")
        with LOCK:
            STATS["requests"] += 1
            STATS["in_flight"] += 1
            STATS["max_in_flight"] = max(STATS["max_in_flight"], STATS["in_flight"])
            STATS["authorization"] = self.headers.get("Authorization")
            failing = STATE["fail_times"] > 0
            STATE["fail_times"] -= failing
            mode, delay_s = STATE["mode"], STATE["delay_s"]
        try:
            time.sleep(delay_s)
            status, answer = self.answer(body, failing, mode)
        finally:
            # Before the reply goes out: once a client has its answer, the next request must not find it in flight.
            with LOCK:
                STATS["in_flight"] -= 1
        self.reply(status, answer)

    def answer(self, body: dict, failing: bool, mode: str) -> tuple[int, bytes]:
        if failing or mode == "http500":
            return 503 if failing else 500, b'{"error": "down"}'
        if mode == "garbage":
            return 200, b"<html>Bad gateway</html>"
        if self.path.endswith("/chat/completions"):
            return 200, self.chat(body)
        return 200, scores_body(body["rows"], mode)

    def chat(self, body: dict) -> bytes:
        prompt = body["messages"][-1]["content"]
        with LOCK:
            STATS["last_prompt"] = prompt
            answer = STATE["answer"].replace("{chars}", str(len(prompt)))
        return json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]}).encode()


if __name__ == "__main__":
    serve(Handler)
