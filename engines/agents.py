"""--agent module:function: train an agent written against OpenAI's chat-completions API, as it is.

Each rank that generates serves an OpenAI-compatible `/v1/chat/completions` on localhost
(`Endpoint`: starlette on uvicorn, in a thread of the rank, bound to 127.0.0.1), backed by its
engine. For every sample it is asked for, `Agents.generate` calls the user's function in a thread
(`--agent-concurrency` at once):

    def my_agent(base_url: str, row: dict) -> float | None:
        client = openai.OpenAI(base_url=base_url, api_key="none")   # base_url names this episode
        reply = client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...                                                          # any agent code, any turns
        return None      # or the episode's reward (added to --rewards', which score the last answer)

and plays every request of the episode token in, token out, as engines/episodes.py plays an
environment's turns: the first request's messages rendered with the chat template are the
episode's prompt; each later request must extend the episode (the messages it sent before, then
the assistant message it was answered with, as its `content` or `tool_calls`), and only the new
messages are added, as the template's delta after the model's sampled tokens (`template_delta`:
nothing is re-tokenised, and a template that rewrites history is refused before the run). The
model's tokens are trained with the engine's log-probs and policy versions; the messages the agent
adds are not (mask 0).

A request that does not extend its episode (the agent rewrote or dropped earlier messages) is
refused (HTTP 400, the episode fails: `stop/rewrite`): a branch would be a second sample of one
row, and a GRPO group has n samples. Streaming is refused too (HTTP 400). The requests of all live
episodes are batched into one engine call: the batcher (this rank's main thread, the only one that
touches the engine) waits until every live episode is waiting for the model or done, or until no
new request has come for --agent-batch-wait-s, then generates them together. The agents run in
threads (a function may be `async`: it then runs in an event loop of its thread); a thread that
hangs cannot be killed, so a hung function keeps its thread, its episode failed and its requests
refused. Budgets end stragglers, counted by cause in `episode/stop/*`: --agent-max-turns model
turns and --max-new-tokens tokens after the prompt (the request past them is refused; the episode
is trained as far as it got), --agent-timeout-s wall seconds (the episode fails). An episode whose
function raises (but not at a budget's refusal), runs past its time, returns something other than
a number or None, rewrites its history or sends what cannot be rendered fails: its sample gets no
reward and leaves the loss (reward/failures counts it).
"""
import asyncio
import inspect
import math
import queue
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from engines.base import Samples
from engines.endpoint import Endpoint, answer_error, assistant_message, check_request, completion, same_turn
from engines.episodes import (AGENT_FAILED, Wrapper, cap, check_template, episode_tensors, template_delta,
                              turn_seed)
from tasks.env import load
from utils.errors import UserError, check_rules

STOPS = ("answer", "max_turns", "length", *AGENT_FAILED)  # why an episode ended
FAILED = AGENT_FAILED  # these episodes leave the loss


@dataclass
class AgentArgs:
    agent: str | None = None
    """an agent to train, module:function: fn(base_url, row) -> reward or None, running any agent code
    against the OpenAI-compatible chat-completions endpoint at base_url, which this run serves from its
    policy (docs/agents.md)"""
    agent_port: int = 0
    """--agent: the endpoint's port on 127.0.0.1 (rank r takes port + r); 0: one the OS picks"""
    agent_concurrency: int = 256
    """--agent: episodes running at once on a rank (threads; the default run's rank plays 256 a step)"""
    agent_timeout_s: float = 60.0
    """--agent: an episode running longer fails (its requests are refused from then on)"""
    agent_max_turns: int = 4
    """--agent: model turns per episode; a request past them is refused and the episode ends (max_turns)"""
    agent_turn_tokens: int = 48
    """--agent: tokens of one model turn, at most (a request's max_tokens may ask for fewer)"""
    agent_tool_tokens: int = 64
    """--agent: tokens of one message the agent adds (a tool result), at most (longer ones are cut)"""
    agent_batch_wait_s: float = 0.05
    """--agent: a batch of requests is generated once no new one has come for this long (or once every live
    episode waits for the model)"""
    agent_model: str = "policy"
    """--agent: the model name the endpoint serves (a request naming another is refused)"""
    APPLIES: ClassVar = {k: ("agent", lambda a: a is not None, "--agent") for k in (
        "agent_port", "agent_concurrency", "agent_timeout_s", "agent_max_turns", "agent_turn_tokens",
        "agent_tool_tokens", "agent_batch_wait_s", "agent_model")}

    def check(self, env):
        check_rules(self, [
            ("agent_port", self.agent_port == 0 or 1024 <= self.agent_port < 65536,
             "use 0 (any free port) or a port from 1024 to 65535"),
            ("agent_concurrency", self.agent_concurrency >= 1, "use 1 or more"),
            ("agent_timeout_s", 0 < self.agent_timeout_s < math.inf, "use a positive number of seconds"),
            ("agent_max_turns", self.agent_max_turns >= 1, "use 1 or more"),
            ("agent_turn_tokens", self.agent_turn_tokens >= 1, "use 1 or more"),
            ("agent_tool_tokens", self.agent_tool_tokens >= 1, "use 1 or more"),
            ("agent_batch_wait_s", self.agent_batch_wait_s >= 0, "use 0 or more seconds")])
        if self.agent is None:
            return
        if env.env is not None or env.tools:
            raise UserError("--agent with --env or --tools: an agent runs its own tools and turns through "
                            "the endpoint; use one of them")
        fn = load(self.agent, "--agent")
        try:
            inspect.signature(fn).bind("http://127.0.0.1:1/v1", {})
        except TypeError:
            raise UserError(f"--agent {self.agent}: the trainer calls fn(base_url, row); make it take those "
                            "two arguments") from None
        except ValueError:
            pass  # a callable Python cannot describe: called as it is


@dataclass
class Episode:
    """One sample's episode: its token list (prompt, then the model's turns and the messages the
    agent added), the chat as rendered so far, and where it stands."""
    key: str
    row: dict
    seed: int
    sample: int
    started: float
    state: str = "queued"  # queued (for a thread), running (agent code), waiting (for the model), done
    prompt: list = field(default_factory=list)  # the first request's rendered prompt ids
    ids: list = field(default_factory=list)  # after the prompt: every token
    mask: list = field(default_factory=list)  # 1 the model's, 0 the agent's
    logp: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    sent: list = field(default_factory=list)  # the messages the agent sent, as it sent them
    history: list = field(default_factory=list)  # the chat as rendered (the model's turns as their text)
    tools: list | None = None
    turns: int = 0
    answer: str = ""  # the model's last turn, as text
    last: dict | None = None  # the last assistant message the agent was answered with
    last_reply: dict | None = None  # the whole answer to the last request (a retry gets it again)
    answer_raw: str = ""  # the same with its special tokens, without its end of turn (template_delta's text)
    last_ids: list = field(default_factory=list)  # the model's last turn's ids, as sampled
    reward: float = 0.0
    stop: str | None = None
    tool_calls: int = 0
    cut: int = 0
    agent_tokens: int = 0


class Agents(Wrapper):
    """An engine that plays --agent episodes over its `Endpoint` (the module's docstring) around
    `engine`. `starts`: the rows by their prompt ids."""

    def __init__(self, engine, cfg: AgentArgs, tok, rows: list[dict], max_new_tokens: int, max_prompt: int,
                 temperature: float, rank: int = 0):
        self.engine, self.cfg, self.tok = engine, cfg, tok
        self.budget, self.max_prompt, self.temperature = max_new_tokens, max_prompt, temperature
        self.fn = load(cfg.agent, "--agent")
        self.starts = {tuple(r["ids"]): r for r in rows}
        self.eos = set(tok.eos_ids)
        check_template(tok, None)  # a template that rewrites history cannot carry an episode
        self.inbox = queue.Queue()  # (episode key, request body, Future) from the server; ("done", ...)
        self.live = {}  # episode key -> Episode, during a generate
        self.endpoint = Endpoint(self, cfg.agent_port + rank if cfg.agent_port else 0)
        self.pool = ThreadPoolExecutor(cfg.agent_concurrency, thread_name_prefix="agent")
        engine.keep_prefixes = True  # a turn extends the last turn's rows: it prefills the new tokens only

    def close(self):
        self.endpoint.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    def generate(self, prompts: list[list[int]], params, seeds: list[int]) -> Samples:
        if not prompts:
            return Samples.empty(self.version)
        eps = []
        for p, seed in zip(prompts, seeds):
            row = self.row(p)
            for j in range(params.n):
                e = Episode(uuid.uuid4().hex, row, seed, j, time.monotonic())
                self.live[e.key] = e
                eps.append(e)
                self.pool.submit(self._run, e)
        try:
            self._serve(eps, params)
        finally:
            for e in eps:
                self.live.pop(e.key, None)
        return self._samples(eps, prompts, params.n)

    def _run(self, e: Episode):
        """A pool thread: the user's function on this episode; its end goes to the batcher's inbox."""
        e.state = "running" if e.state == "queued" else e.state
        try:
            got = self.fn(f"{self.endpoint.url}/episodes/{e.key}/v1", e.row)
            if inspect.isawaitable(got):
                got = asyncio.run(got)
            self.inbox.put(("done", e.key, got, None))
        except BaseException as x:  # noqa: BLE001 (any failure of the user's code is the episode's)
            self.inbox.put(("done", e.key, None, f"{type(x).__name__}: {x}"))

    def _serve(self, eps: list[Episode], params):
        """The batcher: take requests and ends from the inbox, generate when every live episode waits
        (or the first waiting request has waited --agent-batch-wait-s), until every episode is done."""
        pending = []  # (episode, request, Future) ready for the engine
        first = last = None  # when the batch's first and latest requests came
        wait = self.cfg.agent_batch_wait_s
        while any(e.state != "done" for e in eps):
            try:
                item = self.inbox.get(timeout=min(0.01, wait) if pending else 0.2)
            except queue.Empty:
                item = None
            if item is not None and self._take(item, pending):
                last = time.monotonic()
                first = first or last
            now = time.monotonic()
            for e in eps:  # wall-clock budget: a straggler fails, its request (if any) refused
                if e.state != "done" and now - e.started > self.cfg.agent_timeout_s:
                    self._end(e, "timeout")
                    pending = self._refuse(pending, e, "the episode ran past --agent-timeout-s")
            # generate when no episode can add a request (all wait or are done), or when requests have
            # stopped coming for --agent-batch-wait-s (a slow agent does not hold the others up longer),
            # or 20 such waits after the first
            busy = any(e.state in ("queued", "running") for e in eps)
            if pending and (not busy or now - last >= wait or now - first >= 20 * wait):
                self._generate(pending, params)
                pending, first, last = [], None, None
        while not self.inbox.empty():  # what came after the last episode ended: answered, not left waiting
            item = self.inbox.get()
            if item[0] != "done":
                answer_error(item[2], 410, "this episode is over")

    def _take(self, item, pending: list) -> bool:
        """One inbox item: an episode's end, or a request (checked, rendered, queued). -> queued?"""
        if item[0] == "done":
            _, key, got, error = item
            e = self.live.get(key)
            if e is None or e.state == "done":
                return False
            if error is not None:
                self._end(e, "raised")
            elif got is not None and (isinstance(got, bool) or not isinstance(got, (int, float))
                                      or not math.isfinite(got)):
                self._end(e, "bad_return")
            else:
                e.reward = float(got or 0.0)
                self._end(e, e.stop or "answer")
            pending[:] = self._refuse(pending, e, "this episode's function has returned")
            return False
        key, body, future = item
        e = self.live.get(key)
        if e is None or e.state == "done" or e.stop is not None:
            answer_error(future, 410, "this episode is over (it ended, failed or ran out of its budget)")
            return False
        if e.state == "waiting":  # a retry, or requests in parallel: one turn at a time
            answer_error(future, 409, "a request of this episode is already waiting for the model: an "
                                      "episode is one chat, one turn at a time")
            return False
        if e.turns and body.get("messages") == e.sent and (body.get("tools") or None) == e.tools:
            future.set_result((200, e.last_reply))  # the last request again (a client's retry): its answer
            return False
        try:
            error, status = self._add_messages(e, body)
        except Exception as x:  # noqa: BLE001 (what the template cannot render: the episode's, not the run's)
            e.stop = "refused"
            error, status = f"the messages cannot be rendered ({type(x).__name__}: {x})", 400
        if error:
            answer_error(future, status, error)
            if e.stop is not None:
                e.state = "waiting_end"
            return False
        e.state = "waiting"
        pending.append((e, body, future))
        return True

    def _add_messages(self, e: Episode, body: dict) -> tuple[str | None, int]:
        """A request's messages into the episode's tokens: the first renders the prompt; a later one
        must extend what was sent and answered, and its new messages go in as the template's delta.
        -> (an error for the agent, its HTTP status) or (None, 200)."""
        error = check_request(body, self.cfg.agent_model, self.temperature)
        if error:
            return error, 400
        messages, tools = body["messages"], body.get("tools") or None
        if e.turns >= self.cfg.agent_max_turns:
            e.stop = "max_turns"
            return f"the episode has had its --agent-max-turns {self.cfg.agent_max_turns} model turns", 400
        if not e.turns:
            text = self.tok.chat(messages, True, tools)
            e.prompt = self.tok.encode(text, special=False)
            if len(e.prompt) > self.max_prompt:
                e.stop = "refused"
                return (f"the messages render to {len(e.prompt)} tokens, over --max-prompt-tokens "
                        f"{self.max_prompt}"), 400
            e.sent, e.history, e.tools = list(messages), list(messages), tools
            return None, 200
        k = len(e.sent)
        if tools != e.tools or messages[:k] != e.sent or not same_turn(messages[k:k + 1], e.last):
            e.stop = "rewrite"
            return ("the messages do not extend this episode (its earlier messages, then the assistant "
                    "message it was answered with, unchanged): a rewritten history is refused"), 400
        new = [self._cap(e, m) for m in messages[k + 1:]]
        if not new:
            e.stop = "refused"
            return "a request after an answer must add messages (a tool result, a user turn)", 400
        emitted = self.tok.tok.decode(e.last_ids, skip_special_tokens=False)
        delta = template_delta(self.tok, e.history[:-1], e.answer_raw, emitted, new, tools)
        if delta is None:
            e.stop = "refused"
            return "the chat template rewrites earlier turns for these messages", 400
        if len(e.mask) + len(delta) >= self.budget:
            e.stop = "length"
            return f"the episode is out of tokens (--max-new-tokens {self.budget})", 400
        e.ids += delta
        e.mask += [0] * len(delta)
        e.logp += [0.0] * len(delta)
        e.versions += [-1] * len(delta)
        e.agent_tokens += len(delta)
        e.sent = list(messages)
        e.history = e.history + new
        return None, 200

    def _cap(self, e: Episode, message: dict) -> dict:
        """A message the agent added, cut to --agent-tool-tokens (counted)."""
        message, cut = cap(self.tok, message, self.cfg.agent_tool_tokens)
        e.cut += cut
        return message

    def _generate(self, pending: list, params):
        """One engine call for every queued request, then each answered in OpenAI's format."""
        caps = [min(self.cfg.agent_turn_tokens, self.budget - len(e.mask),
                    body.get("max_completion_tokens") or body.get("max_tokens") or self.budget)
                for e, body, _ in pending]
        cap = max(1, max(caps))
        out = self.engine.generate([e.prompt + e.ids for e, _, _ in pending],
                                   replace(params, n=1, max_new_tokens=cap),
                                   [turn_seed(e.seed, e.sample, e.turns) for e, _, _ in pending])
        for k, ((e, body, future), mine) in enumerate(zip(pending, caps)):
            n = min(int(out.lengths[k]), max(0, mine))
            ids, logp = out.tokens[k, :n].tolist(), out.logprobs[k, :n].tolist()
            e.ids += ids
            e.mask += [1] * len(ids)
            e.logp += logp
            e.versions += [out.version] * len(ids)
            e.turns += 1
            e.last_ids = ids
            ended = bool(ids) and ids[-1] in self.eos
            e.answer_raw = self.tok.tok.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
            e.answer = self.tok.decode(ids)
            e.history = e.history + [{"role": "assistant", "content": e.answer_raw}]
            reason = "stop" if ended else "length"
            message, calls = assistant_message(e.answer_raw)
            e.tool_calls += len(calls)
            if calls and ended:
                reason = "tool_calls"
            e.last = message
            e.state = "running"
            context = len(e.prompt) + len(e.ids) - len(ids)
            key = f"{e.key[:12]}-{e.turns}"
            reply = completion(key, self.cfg.agent_model, message, reason, context, len(ids))
            e.last_reply = reply
            if not future.done():  # (a request whose connection was dropped is cancelled)
                future.set_result((200, reply))
            if len(e.mask) >= self.budget:
                e.stop = "length"

    def _refuse(self, pending: list, e: Episode, why: str) -> list:
        for item in pending:
            if item[0] is e:
                answer_error(item[2], 410, why)
        return [item for item in pending if item[0] is not e]

    def _end(self, e: Episode, why: str):
        """The episode is over, `why`. A cause already set stays: a budget's (max_turns, length: the
        function may well raise at the refusal; the episode is trained as far as it got), unless the
        function then fails otherwise (bad_return, timeout); a failure's (rewrite, refused) always."""
        e.state = "done"
        if e.stop is None or (e.stop not in FAILED and why in FAILED and why != "raised"):
            e.stop = why

    def _samples(self, eps: list[Episode], prompts: list, n: int) -> Samples:
        tokens, logprobs, mask, versions, lengths = episode_tensors(
            [(e.ids, e.logp, e.mask, e.versions) for e in eps])
        stats = {"turns": [e.turns for e in eps], "env_tokens": [e.agent_tokens for e in eps],
                 "env_reward": [e.reward for e in eps], "tool_calls": [e.tool_calls for e in eps],
                 "failed": [float(e.stop in FAILED) for e in eps],
                 "tool_error/too_long": [e.cut for e in eps]}
        for why in STOPS:
            stats[f"stop/{why}"] = [float(e.stop == why) for e in eps]
        model_versions = [v for e in eps for v in e.versions if v >= 0]
        return Samples(
            tokens, logprobs, lengths,
            ["stop" if e.stop == "answer" else e.stop for e in eps], [e.answer for e in eps],
            min(model_versions) if model_versions else self.version, model_mask=mask, token_versions=versions,
            episode={k: torch.tensor(v, dtype=torch.float) for k, v in stats.items()},
            transcripts=[self.tok.decode(e.ids) for e in eps],
            prompts=[e.prompt or prompts[i // n] for i, e in enumerate(eps)])


def wrap(local_engine, cfg: AgentArgs, tok, rows: list[dict], max_new_tokens: int, max_prompt: int,
         temperature: float):
    """The engine factory of this run: `local_engine`'s engines as they are, or with --agent wrapped
    in `Agents` (every rank that generates serves its own endpoint)."""
    if cfg.agent is None:
        return local_engine
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return lambda **kw: Agents(local_engine(**kw), cfg, tok, rows, max_new_tokens, max_prompt, temperature,
                               rank)
