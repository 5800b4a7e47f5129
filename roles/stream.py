"""The rollout role's streaming mode (--stream): a rollout rank that never waits for a batch.

In plain disaggregate placement a rollout rank generates one batch per request and each batch waits
for its longest sample. With --stream it runs one `engines.pool.Pool` for the whole run: its
trainers send the prompts of the steps ahead (`Submit`), the pool admits a prompt's n samples as
soon as n rows are free, and each group goes to its trainer the moment its last sample ends; a
trainer's step takes its step's groups whenever they are all in (rollouts.py `Streaming`). New
weights reach the pool between two decode steps; its live samples go on under them (partial
rollouts: their earlier tokens keep the version and log-prob they were sampled with), or with
--partial-rollout-drop start over.

When new weights go in is fixed by the data, not by the clock, so a run is the same every time and a
resumed run is the same run. The rule, with K = --max-staleness: the groups of step j are admitted
under version j - K exactly (every token of step j is then at most K versions old when step j
trains); to admit them the rank needs every group of steps < j - K ended (their trainers can then
train up to version j - K, so waiting for it cannot deadlock) and then waits, if it must, for that
version and for step j's prompts from all its trainers. Until every group of steps < j - K has
ended it decodes the live rows and leaves free rows empty. The weights themselves land in a
listening thread as they come (trainer 0's broadcast never waits for a decode step) and are put in
at that point. The price of the rule: a version that arrives early waits, and the pool stops while
it waits for one that is late (`idle_s`); bench/streaming.py measures both.

At each new version the rank can save what is in flight (the pool's rows, the groups not yet
trained, the prompts it holds): when the trainers saved a checkpoint of that version, it writes
`stream_rollout{rank}.pt` into it, and the checkpoint counts as complete only with it
(utils/checkpoint.py `find`, meta.json's "awaits"). --resume auto then restores the pool as it was,
recomputes its cache under the checkpoint's weights exactly as the uninterrupted run did, and sends
again the groups the trainers had not trained: no prompt skipped or trained twice.
"""
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from engines.native import NativeEngine
from engines.pool import Pool, Request
from engines.vllm_engine import VLLMEngine
from engines.vllm_pool import VLLMPool
from roles.rollout import Generate, Start, Stop, Weights, leave, receive, receive_staged
from utils import dist
from utils.checkpoint import checkpoint_dir
from utils.errors import check_rules

SNAPSHOT = "stream_rollout{rank}.pt"


@dataclass
class StreamArgs:
    stream: bool = False
    """disaggregate, --max-staleness K >= 1: the rollout ranks generate without stopping (a pool that
    admits prompts as samples end; each group streams to its trainer as it ends) and take new
    weights between two decode steps; every token of step j is sampled under version j - K or later
    (docs/streaming.md)"""
    stream_rows: int = 0
    """--stream: samples a rollout rank decodes at once (0: one step's samples of its trainers)"""
    stream_swap: Literal["fixed", "asap"] = "fixed"
    """--stream: when new weights go into the pool. fixed: at a point the data fixes (module docstring of
    roles/stream.py): a run is reproducible bit for bit and resumes exactly, and the pool stops while a
    version it needs is late; asap: between the next two decode steps after they arrive: the pool never
    waits for them, and a run is not reproducible bit for bit (a resume skips or repeats no prompt)"""
    partial_rollout_drop: bool = False
    """--stream: a sample still running when new weights go in starts over under them, instead of
    going on under them (its earlier tokens keeping the version and log-prob that sampled them)"""
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        "stream_rows": ("stream", bool, "--stream"), "partial_rollout_drop": ("stream", bool, "--stream"),
        "stream_swap": ("stream", bool, "--stream")}

    def check(self, args):
        p, vllm = args.placement, args.sampling.engine == "vllm"
        check_rules(self, [
            ("stream", not self.stream or p.placement == "disaggregate",
             f"rollout ranks stream to trainers, and --placement {p.placement} has none: add --placement "
             f"disaggregate --rollout-ranks 1"),
            ("stream", not self.stream or p.max_staleness >= 1,
             "a token may then be sampled under an older version than the step that trains it: add "
             "--max-staleness 1 (or more)"),
            ("stream_swap", not (self.stream and vllm) or self.stream_swap == "asap",
             "a rollout rank's vLLM takes new weights inside trainer 0's broadcast, which waits for it, so "
             "it cannot hold them for a point the data fixes (docs/streaming.md#vllm): add --stream-swap "
             "asap, or use --engine native"),
            ("stream", not (self.stream and vllm) or args.lora.lora_vllm == "merged",
             "vLLM's running requests keep the adapter they started with, and each sync removes it: use "
             "--lora-vllm merged"),
            ("stream", not self.stream or not (args.env.env or args.env.tools or args.agent.agent),
             "tool-using episodes and --agent run turn by turn outside the pool: drop one of the two"),
            ("stream", not self.stream or not args.moe.routing_replay,
             "the pool does not record the experts of its tokens: drop --routing-replay"),
            ("stream", not self.stream or args.advantage != "remax",
             "the greedy baseline of --advantage remax is a second request per step: drop one of the two"),
            ("stream", not self.stream or not args.rebalance.rebalance,
             "the pool does not move between ranks: drop --rebalance"),
            ("stream_swap", not (self.stream and args.dynamic_sampling.dynamic_sampling)
             or self.stream_swap == "asap",
             "--dynamic-sampling decides each wave from the last one's rewards, so no point fixed by the "
             "data can wait for a wave without stopping the rows it depends on: add --stream-swap asap"),
            ("stream_rows", self.stream_rows == 0 or self.stream_rows >= args.num_generations,
             f"a prompt's {args.num_generations} samples are admitted together: use 0 (one step's samples) "
             f"or {args.num_generations} or more")])


class Generator:
    """A rollout rank's streaming loop (`serve` runs it) and its state."""

    def __init__(self, plan, engine: NativeEngine | VLLMEngine, start: Start):
        self.plan, self.engine, self.cfg = plan, engine, start
        self.K, self.n = start.max_staleness, start.params.n
        rows = start.rows or start.step_prompts * self.n * len(plan.served)
        kind = VLLMPool if isinstance(engine, VLLMEngine) else Pool
        self.pool = kind(engine, start.params, rows, start.context)
        self.inbox = queue.Queue()  # (kind, payload) from the listening thread
        self.staged = {}  # version -> [(Weights, tensors)]: received, not yet put in
        self.unseen = []  # [(Weights, tensors)] not yet in the evaluator (a base, then the newest)
        self.applied = None  # the version the pool samples under
        self.queue = []  # Requests not admitted yet, in admission order (step, wave, trainer, index)
        self.submitted = {}  # (step, wave) -> trainers whose prompts for it arrived
        self.complete = {}  # step -> [(Request, Samples)] sent, kept until trained (for a snapshot)
        self.sent = {}  # step -> send handles of its groups, waited once the step is trained
        self.evaluator = None  # a second engine for held-out evaluations, with the newest weights
        # running totals for the trainers' metrics: seconds busy, putting weights in and waiting; the
        # decode steps, and their live rows times seconds (how full the pool ran)
        self.stats = {"busy_s": 0.0, "sync_s": 0.0, "idle_s": 0.0, "decode_s": 0.0, "rows_s": 0.0, "steps": 0}
        self.stopped = False

    # ---- messages
    def listen(self):
        """The listening thread: every message of the trainers, in order; a weight broadcast is
        received here whole (copied out of the bucket buffers) and handed over with its message; one
        that a vLLM engine takes itself is handed over as (message, None), to be taken at once."""
        bufs = {}
        vllm = isinstance(self.engine, VLLMEngine)
        while True:
            try:
                msgs = [dist.recv_obj(r, self.plan.request_group) for r in self.plan.served]
                if isinstance(msgs[0], Weights):
                    own = vllm and not msgs[0].adapters  # vLLM's worker takes them
                    msgs = [(msgs[0], None if own else receive_staged(self.plan, msgs[0], bufs))]
            except RuntimeError as e:
                self.inbox.put(("gone", str(e)[:300]))
                return
            self.inbox.put(("msgs", msgs))
            if isinstance(msgs[0], Stop):
                return

    def handle(self, block: bool) -> bool:
        """Take the messages in the inbox (with block: wait for one first). False once told to stop."""
        t = time.perf_counter()
        try:
            kind, got = self.inbox.get(block=block)
        except queue.Empty:
            return True
        finally:
            self.stats["idle_s"] += time.perf_counter() - t
        while True:
            if kind == "gone":
                leave(self.engine, f"rollout rank {self.plan.rank}: its trainers went away; stopping ({got})")
            self.take(got)
            if self.stopped:
                return False
            try:
                kind, got = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def take(self, msgs: list):
        first = msgs[0]
        if isinstance(first, Stop):
            self.stopped = True
        elif isinstance(first, tuple):  # (Weights, its tensors): full weights, or LoRA's adapters alone
            self.staged.setdefault(first[0].version, []).append(first)
            self.unseen = [first] if not first[0].adapters else [
                p for p in self.unseen if not p[0].adapters] + [first]
            if first[1] is None:  # vLLM's worker takes them now: trainer 0's broadcast waits for it
                self.swap(first[0].version, save=self.applied is not None)  # (the first: nothing to save)
        elif isinstance(first, Generate):  # a held-out evaluation: one batch per trainer, newest weights
            self.evaluate(msgs)
        else:  # Submit, one per trainer
            known = {r.key for r in self.queue} | set(self.pool.requests) | {
                r.key for done in self.complete.values() for r, _ in done}
            for who, m in enumerate(msgs):
                self.submitted.setdefault((m.step, m.wave), set()).add(who)
                for i, (ids, seed) in enumerate(zip(m.prompts, m.seeds)):
                    key = (m.step, m.wave, who, i)
                    if key not in known:  # (a resumed rank already holds what its snapshot held)
                        self.queue.append(Request(key, ids, seed))
            self.queue.sort(key=lambda r: r.key)

    def evaluate(self, msgs: list):
        t = time.perf_counter()
        if isinstance(self.pool, VLLMPool):  # its requests join the stream's, under the newest weights
            answer = self.pool.evaluate
        else:
            if self.evaluator is None:
                e = self.engine
                self.evaluator = NativeEngine(e.cfg, e.tok, e.device, e.dtype)
            _load(self.evaluator, self.unseen, self.plan)
            self.unseen, answer = [], self.evaluator.generate
        for trainer, m in zip(self.plan.served, msgs):
            out = answer(m.prompts, m.params, m.seeds)
            dist.wait_all(dist.isend_obj({"samples": out, "stats": dict(self.stats)}, trainer))
        self.stats["busy_s"] += time.perf_counter() - t

    # ---- the loop
    def run(self):
        """Admit, decode one step, send what ended, take the messages; wait for one only when there
        is nothing to decode and nothing to admit."""
        while self.admit():
            if not self.pool.live:
                if not self.handle(block=True):
                    return
                continue
            t, live = time.perf_counter(), self.pool.live
            ended = self.pool.step()
            took = time.perf_counter() - t
            self.stats["busy_s"] += took
            self.stats["decode_s"] += took
            self.stats["rows_s"] += live * took
            self.stats["steps"] += 1
            for req, samples in ended:
                self.send(req, samples)
            if not self.handle(block=False):
                return

    def next_step(self) -> int:
        """The step whose groups are admitted next: the queue's first, or the first step whose
        prompts have not all come."""
        whole = [s for (s, w), who in self.submitted.items() if w == 0 and len(who) == len(self.plan.served)]
        first = max(whole, default=-1) + 1
        return min(self.queue[0].key[0], first) if self.queue else first

    def here(self, j: int) -> bool:
        """Step j's next prompts (its (step, wave)) have come from every trainer."""
        return (bool(self.queue) and self.queue[0].key[0] == j
                and len(self.submitted.get(self.queue[0].key[:2], ())) == len(self.plan.served))

    def admit(self) -> bool:
        """Admit what the rule allows (module docstring), waiting for prompts and a version when
        it must. False once told to stop. --stream-swap asap: the newest version goes in first, and
        the pool decodes on rather than wait for one."""
        if self.cfg.swap == "asap" and self.staged and max(self.staged) > (self.applied or -1):
            self.swap(max(self.staged))
        while self.pool.free >= self.n:
            j = self.next_step()
            need = max(0, j - self.K)
            if j >= self.cfg.steps or any(r.key[0] < need for r in self.pool.requests.values()):
                return True  # nothing more is coming, or the live rows of older steps end first
            if self.cfg.swap == "asap" and self.pool.live and not (
                    self.here(j) and self.applied is not None and self.applied >= need):
                return True  # decode on; what is missing comes between two steps
            have = self.applied is not None and self.applied >= need

            if not self.here(j) or not (have or need in self.staged):
                if not self.handle(block=True):
                    return False
                continue  # (what came may change the next step: a dynamic-sampling wave of an older one)
            if not have:
                self.swap(need)
            key, take = self.queue[0].key[:2], []
            while self.queue and self.queue[0].key[:2] == key and (len(take) + 1) * self.n <= self.pool.free:
                take.append(self.queue.pop(0))
            t = time.perf_counter()
            self.pool.admit(take)
            self.stats["busy_s"] += time.perf_counter() - t
        return True

    def swap(self, version: int, save: bool = True):
        """Put version `version` in: the groups of older steps are trained (their sends done, their
        copies dropped); save the snapshot when the trainers saved this version; then the pool's
        live rows go on under the new weights (or start over)."""
        t = time.perf_counter()
        for step in [s for s in self.complete if s < version]:
            del self.complete[step]
        for step in [s for s in self.sent if s < version]:
            dist.wait_all(self.sent.pop(step))
        if save:
            self.save(version)
        parts = self.staged.pop(version)
        self.engine.version = self.applied = version
        self.pool.update(lambda: _load(self.engine, parts, self.plan), drop=self.cfg.drop)
        for old in [v for v in self.staged if v < version]:
            del self.staged[old]
        self.stats["sync_s"] += time.perf_counter() - t

    def send(self, req: Request, samples):
        step, wave, who, index = req.key
        self.complete.setdefault(step, []).append((req, samples))
        msg = {"group": (step, wave, index), "samples": samples, "stats": dict(self.stats)}
        self.sent.setdefault(step, []).extend(dist.isend_obj(msg, self.plan.served[who]))

    # ---- what a checkpoint keeps
    def save(self, version: int):
        """When the trainers saved the checkpoint of `version`, what is in flight goes into it."""
        folder = checkpoint_dir(self.cfg.run_dir, version)
        if not os.path.isdir(folder):
            return
        held = [r for r in self.queue if r.key[0] <= version + self.K]  # the later ones depend on timing
        state = {"pool": self.pool.state(), "queue": held, "complete": self.complete,
                 "submitted": {k: v for k, v in self.submitted.items() if k[0] <= version + self.K}}
        path = os.path.join(folder, SNAPSHOT.format(rank=self.plan.rank))
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)

    def resume(self, path: str, version: int) -> bool:
        """A resumed run: the state `save` wrote; the groups not trained go to their trainers again,
        and the pool's cache is rebuilt under the checkpoint's version, as the saving run did."""
        state = torch.load(path, weights_only=False)
        self.pool.load(state["pool"])
        self.queue, self.submitted = state["queue"], state["submitted"]
        for step, done in sorted(state["complete"].items()):
            for req, samples in done:
                self.send(req, samples)
        while version not in self.staged and self.applied != version:  # (a vLLM engine's goes in as it comes)
            if not self.handle(block=True):
                return False
        if self.applied != version:
            self.swap(version, save=False)
        return True


def _load(engine, parts: list, plan):
    """Weights into an engine, part by part: [(Weights, tensors)], full weights or LoRA's adapters;
    tensors None: a vLLM engine's worker takes them from trainer 0's broadcast now."""
    for msg, weights in parts:
        if weights is None:
            receive(plan, engine, msg, {})
        elif msg.adapters:
            engine.load_adapters(weights, msg.adapters)
        else:
            engine.load_weights(weights)


def serve(plan, engine, start: Start):
    """A rollout rank's streaming loop (roles/rollout.py `serve` hands over when a `Start` comes).

    Consumes: from each trainer in `plan.served`, in the same order: `Submit` (its prompts of a
      step), `Weights` (a version, whose broadcast the listening thread receives whole), `Generate`
      (a held-out evaluation, answered at once with the newest weights), `Stop`.
    Waits for: messages when the pool is empty; a version, at the point the rule fixes (module
      docstring).
    Does: one decode step of the pool at a time, admitting between steps.
    Produces: each group, as it ends, to its trainer: {"group": (step, wave, index), "samples",
      "stats"}; a snapshot in each checkpoint of a version it puts in."""
    gen = Generator(plan, engine, start)
    threading.Thread(target=gen.listen, daemon=True).start()
    if not start.snapshot or gen.resume(start.snapshot, start.resumed):
        gen.run()
    return gen.stats
