"""Multi-turn episodes, token in / token out: `Episodes` wraps an engine and plays a whole
episode with an environment (tasks/env.py) for every sample it is asked for, behind the same
`generate` (so every rollout of rollouts.py, the held-out evaluation, dynamic sampling and a
rollout rank's `serve` run episodes unchanged). Chosen before the loop by --env / --tools (`wrap`:
without them the engine is returned as it is).

One running list of token ids per episode: the prompt's, then each model turn's ids verbatim as
the engine sampled them (trained: `model_mask` 1, with the engine's log-probs and the policy
version that made them), then each environment reply as the chat template's *delta* (not
trained: mask 0). The delta is the text the template adds after what the model emitted: render
the chat with the model's turn and the new messages and cut off the render up to the model's
last token. So the boundary tokens the model never emitted (Qwen's "\\n" after <|im_end|>) go
in, untrained, and nothing is ever re-tokenised (a chat re-tokenised at the end is not the
sampled tokens: TRL 5224, verl PR 6921). A template whose render of a longer chat does not
extend its render of the shorter one (Qwen3 strips earlier <think> blocks) cannot continue an
episode token for token: `check_template` refuses it before the run, and an episode that meets
it anyway ends there ("template").

Each turn is one batched `generate` of all this rank's live episodes (the first turn is the
prompts' own request, n samples each); finished episodes leave the batch. The engine keeps each
request's KV cache for the next (`keep_prefixes`): a turn prefills only the tokens added since.
Budgets: --max-turns, --max-turn-tokens a model turn, --max-tool-tokens an environment message,
--max-new-tokens the whole episode after the prompt (the model's and the environment's tokens).
"""
import random
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from engines.base import Engine, Samples
from models.tokenizer import Tokenizer
from tasks.data import tokenize_rows
from tasks.env import ERRORS, ToolEnv, ToolWorker, load, schema
from utils.callables import check_env, check_tool
from utils.errors import UserError, check_rules
from utils.sandbox import TimeLimit, time_limit

STOPS = ("answer", "max_turns", "length", "env_error", "template")  # why an episode ended
# why an --agent episode failed (engines/agents.py): its sample leaves the loss
AGENT_FAILED = ("timeout", "raised", "bad_return", "rewrite", "refused")


@dataclass
class EnvArgs:
    env: str | None = None
    """an environment (one instance per episode), module:Class with reset(row) -> messages and
    step(text) -> (messages, reward, done) (docs/tools.md); with --tools alone, the tool environment"""
    tools: tuple[str, ...] = ()
    """tools, plain Python functions as module:function (tasks.env:multiply: the calculator of
    --dataset builtin:multiply); the model calls them as <tool_call>{...}</tool_call>"""
    max_turns: int = 4
    """--env: model turns per episode, at most"""
    max_turn_tokens: int = 48
    """--env: tokens of one model turn, at most (--max-new-tokens caps the whole episode after the prompt)"""
    max_tool_tokens: int = 64
    """--env: tokens of one environment message, at most (longer ones are cut: tool error too_long)"""
    env_timeout_s: float = 10.0
    """--env: a module:Class environment's reset or step running longer ends its episode (env_error)"""
    tool_timeout_s: float = 5.0
    """--tools: wall-clock limit of one tool call (the tools' process is then killed and restarted)"""
    tool_memory_mb: int = 1024
    """--tools: memory limit of the tools' process"""
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        **{k: ("env", lambda e: e is not None, "--env or --tools") for k in
           ("max_turns", "max_turn_tokens", "max_tool_tokens", "env_timeout_s")},
        **{k: ("tools", bool, "--tools") for k in ("tool_timeout_s", "tool_memory_mb")}}

    def check(self):
        if self.tools and self.env is None:
            self.env = "tools"  # --tools alone: the tool environment
        check_rules(self, [
            ("max_turns", self.max_turns >= 1, "use 1 or more"),
            ("max_turn_tokens", self.max_turn_tokens >= 1, "use 1 or more"),
            ("max_tool_tokens", self.max_tool_tokens >= 1, "use 1 or more"),
            ("env_timeout_s", self.env_timeout_s > 0, "use a positive number of seconds"),
            ("tool_timeout_s", self.tool_timeout_s > 0, "use a positive number of seconds"),
            ("tool_memory_mb", self.tool_memory_mb >= 64, "use 64 or more")])
        if self.env is not None:
            self.check_callables()

    def check_callables(self):
        """The tools and the environment class load and fit what the trainer calls (tasks.env
        `check_tool`, `check_env`), once, before the run; the model calls a tool by its name, so two
        tools may not share one."""
        if self.env == "tools" and not self.tools:
            raise UserError("--env tools: name the tools with --tools module:function ...")
        names = {}
        for spec in self.tools:
            fn = load(spec, "--tools")
            check_tool(fn, f"--tools {spec}")
            if fn.__name__ in names:
                raise UserError(f"--tools {names[fn.__name__]} {spec}: two tools are named {fn.__name__}, "
                                "and the model calls a tool by its name: rename one")
            names[fn.__name__] = spec
        if self.env != "tools":
            check_env(load(self.env, "--env"), self.env)

    def make(self):
        """(a new environment per call, the tools' schemas, the tools' worker or None)."""
        if self.env == "tools" or self.env is None:
            worker = ToolWorker(self.tools, self.tool_timeout_s, self.tool_memory_mb)
            return (lambda: ToolEnv(worker)), [schema(f) for f in worker.functions], worker
        cls = load(self.env, "--env")  # as check_callables found it
        worker = ToolWorker(self.tools, self.tool_timeout_s, self.tool_memory_mb) if self.tools else None
        tools = [schema(f) for f in (worker.functions if worker else getattr(cls, "tools", []))]
        return cls, tools, worker

    def check_model(self, model_dir: str):
        """After --model is known: its chat template can carry an episode (`check_template`)."""
        if self.env is not None:

            _, tools, worker = self.make()
            check_template(Tokenizer(model_dir), tools)
            if worker:
                worker.close()

    def context(self, length: int) -> int:
        """An engine's context for prompts + --max-new-tokens = `length`: one turn's request may
        reach past an episode's own budget by up to --max-turn-tokens (it is cut to it after)."""
        return length + (self.max_turn_tokens if self.env is not None else 0)


def tool_calls(env) -> int:
    """The tool calls an episode's environment says it ran (docs/tools.md): its `calls`, a count
    (ToolEnv's) or the list of the calls; 0 without one (an --env that runs no tools, or that does
    not count them), and 0 for any other value rather than a crash in the middle of a step."""
    calls = getattr(env, "calls", 0)
    if isinstance(calls, (list, tuple)):
        return len(calls)
    return int(calls) if isinstance(calls, (int, float)) and not isinstance(calls, bool) else 0


def tool_errors(env) -> dict:
    """An environment's failed tool calls by kind (ERRORS), its `errors` (ToolEnv's Counter, or any
    dict); {} without one or for another value (docs/tools.md)."""
    errors = getattr(env, "errors", None)
    return errors if isinstance(errors, dict) else {}


def wrap(local_engine, cfg: EnvArgs, tok, rows: list[dict], max_new_tokens: int):
    """The engine factory of this run: `local_engine`'s engines as they are, or, with --env or
    --tools, wrapped in `Episodes` (every rank that generates builds the same)."""
    if cfg.env is None:
        return local_engine
    return lambda **kw: Episodes(local_engine(**kw), cfg, tok, rows, max_new_tokens)


def tokenize(rows: list[dict], tok, cfg: EnvArgs, max_prompt_tokens: int):
    """tasks.data.tokenize_rows for episodes: the prompt is the environment's opening messages
    rendered with the tools' schemas."""

    if cfg.env is None:
        return tokenize_rows(rows, tok, max_prompt_tokens)
    make_env, tools, worker = cfg.make()
    with_messages = []
    for r in rows:
        with_messages.append({**r, "prompt_messages": make_env().reset(r)})
    if worker:
        worker.close()
    return tokenize_rows(with_messages, tok, max_prompt_tokens, tools)


@dataclass
class Episode:
    env: object
    history: list  # the chat so far, as messages
    ids: list  # prompt + episode token ids
    seed: int
    sample: int
    prompt_len: int
    mask: list  # per episode token: 1 model, 0 environment
    logp: list
    versions: list  # per episode token: the policy version (-1: environment)
    turns: int = 0
    reward: float = 0.0
    stop: str | None = None
    answer: str = ""  # the text of the model's last turn
    cut: int = 0  # environment messages cut to --max-tool-tokens
    env_tokens: int = 0


class Wrapper(Engine):
    """What an engine that plays episodes around another shares (`Episodes`; engines/agents.py
    `Agents`): the rest of the engine interface (load_weights, release, receive_weights, backend,
    ...) and the policy version are the wrapped engine's, `self.engine`."""

    def __getattr__(self, name):
        if name == "engine":  # not set yet (during __init__ or a copy)
            raise AttributeError(name)
        return getattr(self.engine, name)

    @property
    def version(self):
        return self.engine.version

    @version.setter
    def version(self, v):
        self.engine.version = v

    def row(self, prompt: list[int]) -> dict:
        """The run's row that `prompt` (its ids) starts, from `self.starts`."""
        row = self.starts.get(tuple(prompt))
        if row is None:
            raise RuntimeError(f"{type(self).__name__}.generate: a prompt that no row of this run starts "
                               "(the engine was built with other rows)")
        return row


def cap(tok, message: dict, limit: int) -> tuple[dict, bool]:
    """A message added to an episode (an environment's, an agent's) with its text cut to `limit`
    tokens (" ...(cut)" marks it) -> (the message, whether it was cut)."""
    ids = tok.encode(str(message.get("content", "")), special=False)
    if len(ids) <= limit:
        return message, False
    return {**message, "content": tok.tok.decode(ids[:limit]) + " ...(cut)"}, True


def episode_tensors(rows: list[tuple]) -> tuple:
    """Each episode's (token ids, log-probs, mask, policy versions) after its prompt -> tokens,
    logprobs, mask (1: the model's token), versions (-1: not the model's) [N, T], each row padded to
    the longest (T >= 1), and the lengths [N]."""
    N, T = len(rows), max(1, max(len(ids) for ids, _, _, _ in rows))
    tokens, logprobs = torch.zeros(N, T, dtype=torch.long), torch.zeros(N, T)
    mask, versions = torch.zeros(N, T), torch.full((N, T), -1, dtype=torch.long)
    for i, (ids, logp, m, v) in enumerate(rows):
        L = len(ids)
        if L:
            tokens[i, :L] = torch.tensor(ids, dtype=torch.long)
            logprobs[i, :L], mask[i, :L] = torch.tensor(logp), torch.tensor(m, dtype=torch.float)
            versions[i, :L] = torch.tensor(v, dtype=torch.long)
    return tokens, logprobs, mask, versions, torch.tensor([len(ids) for ids, _, _, _ in rows])


class Episodes(Wrapper):
    """An engine that plays episodes (see the module's docstring) around `engine`. `starts`: the
    rows by their prompt ids (the trainer asks for prompts by ids; rows with the same prompt share
    their start)."""

    def __init__(self, engine, cfg: EnvArgs, tok, rows: list[dict], max_new_tokens: int):
        self.engine, self.cfg, self.tok, self.budget = engine, cfg, tok, max_new_tokens
        self.make_env, self.tools, self.worker = cfg.make()
        self.starts = {tuple(r["ids"]): r for r in rows}
        self.eos = set(tok.eos_ids)
        check_template(tok, self.tools)
        engine.keep_prefixes = True  # a turn extends the last turn's rows: it prefills the new tokens only

    def close(self):
        if self.worker:
            self.worker.close()
        self.engine.close()

    def generate(self, prompts: list[list[int]], params, seeds: list[int]) -> Samples:
        if not prompts:
            return Samples.empty(self.version)
        eps = []
        for p, seed in zip(prompts, seeds):
            row = self.row(p)
            for j in range(params.n):
                env = self.make_env()
                history = self._call(env, "reset", row)
                if history is not None and not (isinstance(history, list) and history):
                    raise UserError(f"--env {self.cfg.env}: reset(row) returned {str(history)[:80]!r}; it "
                                    "returns the opening chat messages, a list of {'role', 'content'}")
                ep = Episode(env, history or [], list(p), seed, j, len(p), [], [], [])
                if history is None:
                    ep.stop = "env_error"
                eps.append(ep)
        for turn in range(self.cfg.max_turns):
            live = [e for e in eps if e.stop is None]
            if not live:
                break
            cap = min(self.cfg.max_turn_tokens, max(self.budget - len(e.mask) for e in live))
            if turn == 0 and len(live) == len(eps):  # the prompts' own request: n samples each
                out = self.engine.generate(prompts, replace(params, max_new_tokens=cap), seeds)
            else:
                out = self.engine.generate([e.ids for e in live], replace(params, n=1, max_new_tokens=cap),
                                           [turn_seed(e.seed, e.sample, turn) for e in live])
            for k, e in enumerate(live):
                self._turn(e, out, k)
        return self._samples(eps)

    def _call(self, env, method: str, *args):
        """env.reset / env.step under --env-timeout-s; None if it raised or ran past it."""
        try:
            with time_limit(self.cfg.env_timeout_s if not isinstance(env, ToolEnv) else 0):
                return getattr(env, method)(*args)
        except (Exception, TimeLimit):
            return None

    def _turn(self, e: Episode, out: Samples, k: int):
        """Episode e takes row k of this turn's samples; the environment answers."""
        n = int(out.lengths[k])
        room = self.budget - len(e.mask)
        ids, logp = out.tokens[k, :min(n, room)].tolist(), out.logprobs[k, :min(n, room)].tolist()
        e.ids += ids
        e.mask += [1] * len(ids)
        e.logp += logp
        e.versions += [out.version] * len(ids)
        e.turns += 1
        ended = bool(ids) and ids[-1] in self.eos
        text = self.tok.tok.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
        e.answer = self.tok.decode(ids)
        if n > room or out.finish_reasons[k] == "length":
            e.stop = "length"
            return
        got = self._call(e.env, "step", text)
        if got is None:
            e.stop = "env_error"
            return
        if not (isinstance(got, tuple) and len(got) == 3 and isinstance(got[0], list)):
            raise UserError(f"--env {self.cfg.env}: step(text) returned {str(got)[:80]!r}; it returns (a "
                            "list of new messages, a reward, whether the episode is over)")
        messages, reward, done = got
        e.reward += float(reward)
        if done:
            e.stop = "answer"
            return
        if e.turns == self.cfg.max_turns:
            e.stop = "max_turns"
            return
        messages = [self._cap(e, m) for m in messages]  # each cut to --max-tool-tokens (counted)
        emitted = self.tok.tok.decode(ids, skip_special_tokens=False)
        new = template_delta(self.tok, e.history, text, emitted, messages, self.tools)
        if new is None:
            e.stop = "template"
            return
        e.history = e.history + [{"role": "assistant", "content": text}] + messages
        if len(e.mask) + len(new) >= self.budget:
            e.stop = "length"
            return
        e.ids += new
        e.mask += [0] * len(new)
        e.logp += [0.0] * len(new)
        e.versions += [-1] * len(new)
        e.env_tokens += len(new)

    def _cap(self, e: Episode, message: dict) -> dict:
        message, cut = cap(self.tok, message, self.cfg.max_tool_tokens)
        e.cut += cut
        return message

    def _samples(self, eps: list[Episode]) -> Samples:
        tokens, logprobs, mask, versions, lengths = episode_tensors(
            [(e.ids[e.prompt_len:], e.logp, e.mask, e.versions) for e in eps])
        stats = {"turns": [e.turns for e in eps], "env_tokens": [e.env_tokens for e in eps],
                 "env_reward": [e.reward for e in eps],
                 "tool_calls": [tool_calls(e.env) for e in eps]}
        for kind in ERRORS:
            counts = [tool_errors(e.env).get(kind, 0) for e in eps]
            if kind == "too_long":  # and the messages cut to --max-tool-tokens
                counts = [c + e.cut for c, e in zip(counts, eps)]
            stats[f"tool_error/{kind}"] = counts
        for why in STOPS:
            stats[f"stop/{why}"] = [float(e.stop == why) for e in eps]
        model_versions = [v for e in eps for v in e.versions if v >= 0]
        return Samples(
            tokens, logprobs, lengths,
            ["stop" if e.stop == "answer" else e.stop for e in eps], [e.answer for e in eps],
            min(model_versions) if model_versions else self.version, model_mask=mask, token_versions=versions,
            episode={k: torch.tensor(v, dtype=torch.float) for k, v in stats.items()},
            transcripts=[self.tok.decode(e.ids[e.prompt_len:]) for e in eps])


def turn_seed(seed: int, sample: int, turn: int) -> int:
    """The sampling seed of one episode's turn >= 1 (turn 0 is the prompt's own seed, sample j)."""
    return random.Random(f"{seed}-{sample}-turn{turn}").getrandbits(31)


def template_delta(tok, history: list[dict], text: str, emitted: str, messages: list[dict], tools):
    """The ids of what the chat template adds after the model's turn: its boundary (what the
    template puts after the model's last token, e.g. Qwen's "\\n" after <|im_end|>) and the new
    `messages`, up to the next assistant header. text: the turn's content (without its end-of-turn
    token); emitted: the turn as sampled (with it). None if the template's render of the longer
    chat does not extend its render of the shorter one (it rewrote the history)."""
    before = tok.chat(history, True, tools) + emitted  # what the episode's ids hold, as text
    turn = history + [{"role": "assistant", "content": text}]
    after_turn = tok.chat(turn, False, tools)
    full = tok.chat(turn + messages, True, tools)
    if not (after_turn.startswith(before) and full.startswith(after_turn)):
        return None
    return tok.encode(full[len(before):], special=False)


def check_template(tok, tools):
    """Before the run: the chat template can carry an episode token for token (a model turn, a tool
    reply, another turn rendered incrementally equals the whole chat rendered at once)."""
    if tok.chat_template is None:
        raise UserError(f"--env / --tools: the tokenizer in {tok.path} has no chat template to render turns "
                        "and tool messages with: add one (tokenizer_config.json's chat_template)")
    eos = tok.eos_token or ""
    history = [{"role": "user", "content": "2*3="}]
    reply = [{"role": "tool", "name": "multiply", "content": "6"}]
    if template_delta(tok, history, "<tool_call>{}</tool_call>", "<tool_call>{}</tool_call>" + eos, reply,
                      tools) is None:
        raise UserError(f"the chat template of {tok.path} rewrites earlier turns when a turn is added (its "
                        "render of a longer chat does not extend the shorter one's), so an episode cannot go "
                        "on token for token; use a template that keeps the history as it was rendered")


STATS = ("turns", "env_tokens", "env_reward", "tool_calls", *(f"tool_error/{k}" for k in ERRORS),
         *(f"stop/{k}" for k in STOPS + AGENT_FAILED), "failed")


def sums(out: Samples) -> dict:
    """This rank's episode numbers, to sum over the trainers (zeros for single-turn samples, and for
    what an episode's kind does not count: every rank reduces the same keys)."""
    got = {f"episode/{k}": float(out.episode[k].sum()) if k in out.episode else 0.0 for k in STATS}
    got["episode/count"] = len(out.texts) if out.episode else 0
    got["episode/calling"] = int((out.episode["tool_calls"] > 0).sum()) if out.episode else 0
    return got


def metrics(total: dict) -> dict:
    """rank 0's episode/ metrics from `sums` summed: per episode means, the share that called a
    tool at least once (tool_call_rate), tool errors by kind (counts a step), why episodes ended
    (shares). Nothing for single-turn runs."""
    E = total.get("episode/count", 0)
    if not E:
        return {}
    out = {"episode/tool_call_rate": total["episode/calling"] / E}
    for k in STATS:
        per_step = k.startswith("tool_error/")
        out[f"episode/{k}"] = total[f"episode/{k}"] / (1 if per_step else E)
    return out
