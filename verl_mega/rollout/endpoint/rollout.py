"""A rollout through the endpoint: every sample is a session that the user's agent drives over HTTP.

`EndpointRollout.run(engine, conversations, params)` starts the server, gives each of the `params.n` samples per
conversation its own session and runs the agent (`module:function`, sync or async) once per sample with
`base_url` (the session's `.../v1`, what any OpenAI-compatible framework takes), `session_id` and `messages`
(the data row's prompt). The agent returns a reward (a number) or None (the reward function scores the
episode). The calling thread drives the engine: it gathers the turns the sessions ask for into generation
rounds, so concurrent sessions are decoded in one batch.

Rounds run in lockstep where the agents keep up: a round starts once every session still able to ask for a turn
has asked (or `batch_wait_s` after the first waiting request, so a slow agent delays the others that long at
most). Round r samples with `params.seed + r * TURN_SEED_STRIDE`, one sample per session: with a deterministic
agent, the rounds and their seeds are the in-process agent loop's turns, and so are the trajectories.

Every session ends: the agent returns or raises, or its `timeout_s` wall clock runs out (its requests are then
refused and the agent abandoned: a sync agent's thread is left to finish on its own, an async agent's task is
cancelled); `max_turns` and the token budget end its trajectory, and each further request is refused. A sample
is dropped, counted in `endpoint/dropped_<why>` and named in `EndpointResult.problems`, where its agent raised
(before a limit ended its session), hung past the wall clock, returned something other than a number or None,
or took no turn.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import itertools
import math
import re
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

from verl_mega.config.named_functions import import_function
from verl_mega.rollout.agent_loop import TURN_SEED_STRIDE, ChatRenderer, TurnRules, resolve_tool_call_format
from verl_mega.rollout.engine import Response, RolloutEngine, SamplingParams

from .openai_format import EndpointError, parse_chat, parse_completion
from .server import EndpointServer
from .sessions import MODEL_NAME, Session, SessionLimits, Turn

ROUTE = re.compile(r"/sessions/([^/]+)/v1/(chat/completions|completions|models)")
DROP_REASONS = ("raised", "timeout", "bad_reward", "no_turn")


def load_agent(spec: str) -> Callable:
    """The agent function named "package.module:function"; UserError (a ValueError) naming the problem."""
    return import_function(spec, "the agent")


@dataclass
class EndpointResult:
    """Per sample (prompt-major, `n` per prompt): its Response (with the reward its agent returned as
    `episode.agent_reward`), or None where it was dropped. `problems`: one line per dropped sample."""

    responses: list[Response | None]
    problems: list[str]
    metrics: dict[str, float]


class EndpointRollout:
    """Samples of `max_turns` turns and `budget` response tokens at most, each driven by `agent` through the
    endpoint; `stop_token_ids` (EOS) and the template's end-of-turn token end a turn; `max_model_len`: the
    engine's context length."""

    def __init__(self, tokenizer, agent: Callable, *, max_turns: int, budget: int, stop_token_ids: Sequence[int],
                 max_model_len: int, tool_call_format: str = "auto", timeout_s: float = 600.0,
                 batch_wait_s: float = 1.0, host: str = "127.0.0.1"):
        if max_turns < 1 or budget < 1 or timeout_s <= 0 or batch_wait_s < 0:
            raise ValueError(f"max_turns ({max_turns}) and budget ({budget}) must be >= 1, timeout_s ({timeout_s}) "
                             f"> 0 and batch_wait_s ({batch_wait_s}) >= 0")
        fmt = resolve_tool_call_format(tool_call_format, tokenizer.chat_template)
        stops = TurnRules(tokenizer, ChatRenderer(tokenizer, []), fmt, max_turns, stop_token_ids).stop_token_ids
        self.limits = SessionLimits(tokenizer, fmt, max_turns, budget, frozenset(stops), max_model_len)
        self.agent, self.timeout_s, self.batch_wait_s, self.host = agent, timeout_s, batch_wait_s, host

    def run(self, engine: RolloutEngine, conversations: Sequence[list[dict]], params: SamplingParams
            ) -> EndpointResult:
        return _Run(self, engine, conversations, params).result()


@dataclass
class _Pending:
    slot: "_Slot"
    turn: Turn
    since: float
    future: Future = field(default_factory=Future)


@dataclass
class _Slot:
    """A session and its agent: `outcome` ("returned", value) / ("raised", error) / ("timeout", None) once the
    agent is done with it."""

    session: Session
    messages: list[dict]
    deadline: float
    busy: bool = False
    outcome: tuple[str, object] | None = None
    pending: _Pending | None = None


class _Run:
    """One `EndpointRollout.run`: the sessions, the server's requests and the engine's rounds."""

    def __init__(self, rollout: EndpointRollout, engine: RolloutEngine, conversations: Sequence[list[dict]],
                 params: SamplingParams):
        self.rollout, self.engine = rollout, engine
        self.params = dataclasses.replace(params, n=1, stop_token_ids=tuple(sorted(
            set(params.stop_token_ids) | rollout.limits.stop_token_ids)))
        self.cond = threading.Condition()
        self.pending: list[_Pending] = []
        self.rejected: Counter = Counter()
        self.batches: list[int] = []
        self.closed = False
        self.loop_thread: threading.Thread | None = None  # async agents' event loop
        deadline = time.monotonic() + rollout.timeout_s
        run_id = uuid.uuid4().hex[:8]
        self.slots = {}
        for prompt_index, messages in enumerate(conversations):
            for _ in range(params.n):
                index = len(self.slots)
                session = Session(f"{run_id}-{index}", index, prompt_index, rollout.limits)
                self.slots[session.id] = _Slot(session, list(messages), deadline)

    # --- the server's side (one thread per request) ---------------------------------------------------------

    def handle(self, method: str, path: str, body) -> tuple[int, dict]:
        try:
            return self._handle(method, path, body)
        except EndpointError as err:
            self.refused(err.code)
            raise

    def refused(self, code: str) -> None:
        with self.cond:
            self.rejected[code] += 1

    def _handle(self, method: str, path: str, body) -> tuple[int, dict]:
        match = ROUTE.fullmatch(path.split("?", 1)[0])
        if match is None:
            raise EndpointError(404, "not_found", f"no route {method} {path[:200]}: the routes are POST "
                                "/sessions/<id>/v1/chat/completions and /sessions/<id>/v1/completions")
        session_id, route = match.groups()
        slot = self._claim(session_id, method, route)
        if slot is None:  # GET models
            return 200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "verl_mega"}]}
        try:
            session = slot.session
            if route == "chat/completions":
                turn = session.chat_turn(parse_chat(body))
                return 200, session.chat_answer(self._generated(slot, turn), turn)
            turn = session.completion_turn(parse_completion(body))
            return 200, session.completion_answer(self._generated(slot, turn), turn)
        finally:
            with self.cond:
                slot.busy = False
                self.cond.notify_all()

    def _claim(self, session_id: str, method: str, route: str) -> _Slot | None:
        """The session's slot, marked busy for this request; None for GET models."""
        with self.cond:
            slot = self.slots.get(session_id)
            if slot is None:
                raise EndpointError(404, "unknown_session", f"unknown session {session_id[:80]!r}: an agent "
                                    "calls the base_url it was given for its sample")
            if route == "models" and method == "GET":
                return None
            if method != "POST":
                raise EndpointError(405, "method_not_allowed", f"{method} {route}: POST it")
            self._check_live(slot)
            if slot.busy:
                raise EndpointError(409, "session_busy", "a request of this session is already being answered: "
                                    "one request at a time per session")
            slot.busy = True
            return slot

    def _check_live(self, slot: _Slot) -> None:
        if slot.outcome is not None and slot.outcome[0] == "timeout":
            raise EndpointError(408, "session_closed", "session closed: its wall clock ran out")
        if slot.outcome is not None or self.closed:
            raise EndpointError(410, "session_closed", "session closed: its agent is done or the rollout is over")

    def _generated(self, slot: _Slot, turn: Turn) -> Response:
        """The turn, sampled in the engine's next round; EndpointError where the session closes meanwhile."""
        with self.cond:
            self._check_live(slot)
            slot.pending = _Pending(slot, turn, time.monotonic())
            self.pending.append(slot.pending)
            self.cond.notify_all()
        return slot.pending.future.result()

    # --- the agents' side -----------------------------------------------------------------------------------

    def _start_agents(self, base_url: str) -> asyncio.AbstractEventLoop | None:
        agent = self.rollout.agent
        loop = None
        if inspect.iscoroutinefunction(agent):
            loop = asyncio.new_event_loop()
            self.loop_thread = threading.Thread(target=loop.run_forever, name="endpoint-agents", daemon=True)
            self.loop_thread.start()
        for session_id, slot in self.slots.items():
            kwargs = {"messages": copy.deepcopy(slot.messages), "base_url": f"{base_url}/sessions/{session_id}/v1",
                      "session_id": session_id}
            if loop is not None:
                future = asyncio.run_coroutine_threadsafe(agent(**kwargs), loop)
                future.add_done_callback(lambda done, slot=slot: self._finish(slot, _outcome_of(done)))
            else:
                threading.Thread(target=self._run_sync, args=(slot, kwargs), name=f"agent-{session_id}",
                                 daemon=True).start()
        return loop

    def _run_sync(self, slot: _Slot, kwargs: dict) -> None:
        try:
            outcome = ("returned", self.rollout.agent(**kwargs))
        except BaseException as err:  # whatever the agent raises is its sample's outcome
            outcome = ("raised", err)
        self._finish(slot, outcome)

    def _finish(self, slot: _Slot, outcome: tuple[str, object]) -> None:
        with self.cond:
            if slot.outcome is None:
                slot.outcome = outcome
                self._fail_pending(slot, EndpointError(410, "session_closed", "session closed: its agent is done"))
            self.cond.notify_all()

    def _fail_pending(self, slot: _Slot, error: EndpointError) -> None:
        pending, slot.pending = slot.pending, None
        if pending is not None and not pending.future.done():
            self.pending = [p for p in self.pending if p is not pending]
            pending.future.set_exception(error)

    # --- the engine's side (the calling thread) -------------------------------------------------------------

    def result(self) -> EndpointResult:
        with EndpointServer(self.handle, self.refused, self.rollout.host) as server:
            loop = self._start_agents(server.url)
            try:
                while (batch := self._next_round()) is not None:
                    self._generate(batch)
            finally:
                self._close(loop)
        return self._collect()

    def _next_round(self) -> list[_Pending] | None:
        """The turns of the next round, once every session able to ask has asked (or `batch_wait_s` after the
        first asked); None once every agent is done."""
        wait_s = self.rollout.batch_wait_s
        with self.cond:
            while True:
                now = time.monotonic()
                live = [slot for slot in self.slots.values() if slot.outcome is None]
                for slot in live:
                    if now >= slot.deadline:
                        slot.outcome = ("timeout", None)
                        self._fail_pending(slot, EndpointError(408, "session_closed",
                                                               "session closed: its wall clock ran out"))
                live = [slot for slot in live if slot.outcome is None]
                if not live:
                    return None
                wake = min(slot.deadline for slot in live)
                if self.pending:
                    askers = sum(1 for slot in live if slot.session.ended is None)
                    oldest = min(p.since for p in self.pending)
                    if len(self.pending) >= askers or now - oldest >= wait_s:
                        # In sample order, whatever order they came in: the round is the same batch each run.
                        batch = sorted(self.pending, key=lambda p: p.slot.session.index)
                        self.pending = []
                        for p in batch:
                            p.slot.pending = None
                        return batch
                    wake = min(wake, oldest + wait_s)
                self.cond.wait(timeout=max(0.0, wake - now))

    def _generate(self, batch: list[_Pending]) -> None:
        seed = None if self.params.seed is None else self.params.seed + len(self.batches) * TURN_SEED_STRIDE
        params = dataclasses.replace(self.params, seed=seed, max_new_tokens=max(p.turn.max_new for p in batch))
        self.batches.append(len(batch))
        contexts, n = shared_contexts([(p.slot.session.prompt_index, p.turn.context) for p in batch])
        try:
            responses = self.engine.generate(contexts, dataclasses.replace(params, n=n))
        except BaseException as err:
            for p in batch:
                p.future.set_exception(EndpointError(500, "engine_error", f"the engine failed: {err}"))
            raise
        for p, response in zip(batch, responses, strict=True):
            p.future.set_result(response)

    def _close(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """No request is taken any more; the requests still waiting are refused, async agents cancelled; the
        sessions' last answers are written before the trajectories are read."""
        with self.cond:
            self.closed = True
            for slot in self.slots.values():
                if slot.outcome is None:
                    slot.outcome = ("timeout", None)
                self._fail_pending(slot, EndpointError(410, "session_closed", "session closed: the rollout is over"))
            self.cond.wait_for(lambda: not any(slot.busy for slot in self.slots.values()), timeout=10.0)
        if loop is not None:  # the agents still running are cancelled, and their cancellation run, on their loop
            try:
                asyncio.run_coroutine_threadsafe(_cancel_tasks(), loop).result(timeout=10.0)
            finally:
                loop.call_soon_threadsafe(loop.stop)
                self.loop_thread.join(timeout=10.0)
                if not self.loop_thread.is_alive():  # else an agent blocks its loop's thread: left to it
                    loop.close()

    def _collect(self) -> EndpointResult:
        responses, problems, drops = [], [], Counter()
        for slot in self.slots.values():
            session, (kind, value) = slot.session, slot.outcome
            reason = _drop_reason(session, kind, value)
            if reason is None:
                response = session.episode.response(session.prompt_ids, self.params.logprobs)
                reward = None if kind != "returned" or value is None else float(value)
                responses.append(dataclasses.replace(response, episode=dataclasses.replace(
                    response.episode, agent_reward=reward)))
                continue
            drops[reason[0]] += 1
            problems.append(f"sample {session.index} (session {session.id}): {reason[1]}")
            responses.append(None)
        metrics = {"endpoint/sessions": len(self.slots), "endpoint/dropped": sum(drops.values()),
                   **{f"endpoint/dropped_{reason}": drops[reason] for reason in DROP_REASONS},
                   "endpoint/limit_ended": sum(slot.session.ended is not None for slot in self.slots.values()),
                   "endpoint/agent_rewards": sum(response is not None and response.episode.agent_reward is not None
                                                 for response in responses),
                   "endpoint/engine_calls": len(self.batches),
                   "endpoint/batch_mean": sum(self.batches) / len(self.batches) if self.batches else 0.0,
                   "endpoint/rejected_requests": sum(self.rejected.values()),
                   **{f"endpoint/rejected/{code}": count for code, count in sorted(self.rejected.items())}}
        return EndpointResult(responses, problems, metrics)


def shared_contexts(turns: list[tuple[int, list[int]]]) -> tuple[list[list[int]], int]:
    """(the distinct contexts, n) where `turns`, (prompt index, context) in sample order, are runs of n sessions of
    one prompt asking with one context (a first round), which the engine then prefills once each and samples n
    times, as the in-process loop's first turn does (both engines sample the same tokens either way); else (every
    context, 1). Equal contexts of different prompts stay apart, as the loop keeps them."""
    runs = [len(list(group)) for _, group in itertools.groupby(turns)]
    if len(set(runs)) != 1 or runs[0] == 1:
        return [context for _, context in turns], 1
    return [context for _, context in turns[::runs[0]]], runs[0]


async def _cancel_tasks() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=5.0)


def _outcome_of(done) -> tuple[str, object]:
    if done.cancelled():
        return "timeout", None
    error = done.exception()
    return ("raised", error) if error is not None else ("returned", done.result())


def _drop_reason(session: Session, kind: str, value) -> tuple[str, str] | None:
    """(reason, line) where the sample is dropped, else None."""
    if kind == "timeout":
        return "timeout", "the agent did not return within its wall clock (rollout.multi_turn.agent_timeout_s)"
    if kind == "raised" and session.ended is None:
        return "raised", f"the agent raised {type(value).__name__}: {str(value).splitlines()[0][:300] if str(value) else ''}"
    if not session.turns:
        return "no_turn", "the agent asked for no turn"
    if kind == "returned" and value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                                     or not math.isfinite(value)):
        return "bad_reward", f"the agent returned {str(value)[:80]!r}: a reward is a finite number, or None"
    return None
