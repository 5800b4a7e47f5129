"""The rollout role: ranks that generate with the policy for other ranks.

disaggregate: ranks that only generate. A trainer reaches its rollout rank through
`RemoteEngine`, which has the same methods as a local engine (engines/native.py), and the
rollout rank runs `serve`. They speak in the four messages below, pickled over point-to-point
sends (utils/dist.py); the weights themselves never travel as messages but as a bucketed
broadcast from trainer 0: over the weight group into a native engine, or through vLLM's
weight-transfer layer straight into a vLLM engine's worker (engines/vllm_transfer.py).
`agree_on_transfer` settles, once a layout, how the rollout ranks take weights.
"""
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass

import torch

from engines.base import Samples
from engines.decode import SamplingParams
from utils import dist, errors

# ---- the messages a trainer sends its rollout rank (every trainer of a rollout rank sends the same sequence)

@dataclass
class Weights:
    """Policy `version` follows as trainer 0's broadcast over the weight group, bucket by bucket."""
    version: int
    specs: list  # (hf_name, shape, dtype) in broadcast order
    bucket_bytes: int
    adapters: dict | None = None  # LoRA, adapters only: {module: alpha / r}; the specs are lora_A/B's


@dataclass
class Generate:
    """Sample `params.n` completions of each prompt; answered with {"samples", "stats"}."""
    prompts: list[list[int]]
    params: SamplingParams
    seeds: list[int]


@dataclass
class Stop:
    """No more messages: the rollout rank leaves its loop."""


@dataclass
class Submit:
    """--stream: this trainer's prompts of (step, wave), n samples each; each group is answered on
    its own, as it ends: {"group": (step, wave, index), "samples", "stats"}."""
    step: int
    wave: int
    prompts: list[list[int]]
    seeds: list[int]


@dataclass
class Start:
    """--stream, once, before the first weights: the rollout rank leaves `serve` for roles/stream.py's
    loop, whose pool this sets up."""
    params: SamplingParams
    max_staleness: int  # K: the groups of step j are admitted under version j - K
    steps: int  # the run's steps: none after them is coming
    step_prompts: int  # prompts per step of each trainer
    context: int  # the longest prompt plus max_new_tokens
    rows: int  # --stream-rows (0: one step's samples of its trainers)
    drop: bool  # --partial-rollout-drop
    swap: str  # --stream-swap
    run_dir: str  # where the trainers' checkpoints are, to save what is in flight into them
    snapshot: str | None = None  # a resumed run: what was in flight at the checkpoint's version
    resumed: int = 0  # that version (the steps done)


@dataclass
class Move:
    """--rebalance, in process: the ranks move to `layout` (a placement.Layout); `serve` returns it."""
    layout: object
    bucket_bytes: int


class RemoteEngine:
    """A trainer's handle on its rollout rank, behind the engine interface.

    Requests go out with non-blocking sends and the samples come back in request order, so a
    trainer can submit step k+1 and train step k while the rollout rank generates. Requests
    travel on `plan.request_group`, whose timeout is long because the rollout rank waits there
    through whole training steps; replies come back on the default group, so a rollout rank that
    hangs fails its trainers after --timeout-s, and one that dies fails them at once (its
    connections close)."""

    def __init__(self, plan, specs, bucket_bytes: int):
        self.plan, self.specs, self.bucket_bytes = plan, specs, bucket_bytes
        self.peer = plan.rollout_peer
        self.buckets = dist.plan_buckets(specs, bucket_bytes)
        self.version = 0  # the policy version the rollout rank holds (set by placement.sync)
        self.next = 0  # the next ticket
        self.done = {}  # ticket -> Samples received, not yet taken
        self.sent = deque()  # (ticket or None, send handles) in send order
        # the rollout rank's running totals, as its last reply carried them
        self.stats = {"busy_s": 0.0, "sync_s": 0.0, "idle_s": 0.0}
        self.seen = {}  # the totals at the last `take_stats`
        self.bufs = {}  # trainer 0's bucket buffers, kept across syncs
        self.transfer = None  # trainer 0, vLLM rollout engines: its end of their transfer group
        self.takes_adapters = False  # LoRA: the rollout ranks take adapters alone (agree_on_transfer)
        self.has_base = False  # LoRA: the rollout ranks hold the base weights, adapters alone may follow
        self.moved = False  # the ranks moved to another layout: this handle says nothing more
        self.streaming = False  # --stream: groups come as they end (`start_stream`)
        self.groups = {}  # --stream: (step, wave) -> {index: Samples} received, not yet taken

    def _fail(self, e, doing):
        return RuntimeError(f"rollout rank {self.peer} stopped answering while {doing}: it died or hung "
                            f"(see its output above). The trainers stop here. {errors.newest_checkpoint()} "
                            f"({e})")

    def _send(self, msg, ticket=None):
        try:
            handles = dist.isend_obj(msg, self.peer, self.plan.request_group)
            if self.streaming:  # a streaming rollout rank listens all the time: nothing stays in flight
                dist.wait_all(handles)
            else:
                self.sent.append((ticket, handles))
        except RuntimeError as e:
            raise self._fail(e, f"taking a {type(msg).__name__} message") from e

    def announce_weights(self, adapters: tuple | None = None):
        """Every trainer: tell the rollout rank that policy `self.version` comes next (LoRA's
        adapters only: `adapters` = (their specs, {module: scale})). It is sent after every reply
        still due, because the rollout rank serves in order."""
        self.collect()
        if adapters is None:
            self._send(Weights(self.version, self.specs, self.bucket_bytes))
        else:
            self._send(Weights(self.version, adapters[0], self.bucket_bytes, adapters[1]))
            self.adapter_buckets = dist.plan_buckets(adapters[0], self.bucket_bytes)

    def broadcast_weights(self, weights, adapters: bool = False):
        """Trainer 0 only: the (name, tensor) stream, in buckets, to every rollout rank (LoRA's
        adapters always over the weight group, to a vLLM rollout rank too)."""
        try:
            if self.transfer is not None and not adapters:
                self.transfer.send(weights)
            else:
                group, device = self.plan.weight_group, self.plan.device
                buckets = self.adapter_buckets if adapters else self.buckets
                dist.broadcast_buckets(weights, buckets, 0, group, device, self.bufs)
        except RuntimeError as e:
            raise self._fail(e, "the weights were broadcast to it") from e

    def submit(self, prompts, params, seeds) -> int:
        ticket = self.next
        self.next += 1
        self._send(Generate(prompts, params, seeds), ticket)
        return ticket

    def result(self, ticket: int) -> Samples:
        while self.streaming and ticket not in self.done:  # one request at a time, between groups
            self.done[ticket] = self._reply()["samples"]
        while ticket not in self.done:  # replies come in request order
            try:
                reply = dist.recv_obj(self.peer)
            except RuntimeError as e:
                raise self._fail(e, "generating") from e
            self.stats = reply["stats"]
            while True:  # a reply means its request, and every message before it, has arrived
                sent_ticket, handles = self.sent.popleft()
                dist.wait_all(handles)
                if sent_ticket is not None:
                    self.done[sent_ticket] = reply["samples"]
                    break
        return self.done.pop(ticket)

    # ---- --stream (roles/stream.py): prompts go out ahead, groups come back as they end
    def start_stream(self, start: Start):
        self._send(start)
        self.streaming = True
        self.stats.update({"decode_s": 0.0, "rows_s": 0.0, "steps": 0})  # the pool's (roles/stream.py)

    def submit_groups(self, step: int, wave: int, prompts: list, seeds: list):
        self._send(Submit(step, wave, prompts, seeds))

    def take_groups(self, step: int, wave: int, count: int) -> Samples:
        """The `count` groups of (step, wave), in prompt order, once all have come."""
        while len(self.groups.get((step, wave), ())) < count:
            self._receive()
        got = self.groups.pop((step, wave), {})
        return Samples.cat([got[i] for i in range(count)]) if count else Samples.empty(self.version)

    def _reply(self) -> dict:
        """The next message that is not a group (the groups before it are kept)."""
        reply = None
        while reply is None:
            reply = self._receive()
        return reply

    def _receive(self) -> dict | None:
        """One message: a group is kept (None), anything else returned."""
        try:
            reply = dist.recv_obj(self.peer)
        except RuntimeError as e:
            raise self._fail(e, "generating") from e
        self.stats = reply["stats"]
        if "group" not in reply:
            return reply
        step, wave, index = reply["group"]
        self.groups.setdefault((step, wave), {})[index] = reply["samples"]
        return None

    def collect(self):
        """Receive every reply still due (kept for `result`)."""
        if self.streaming:
            return  # groups keep coming: weights go out without waiting for them
        pending = [t for t, _ in self.sent if t is not None]
        if pending:
            self.done[pending[-1]] = self.result(pending[-1])

    def generate(self, prompts, params, seeds) -> Samples:
        return self.result(self.submit(prompts, params, seeds))

    def take_stats(self) -> dict:
        """The rollout rank's seconds busy generating, loading weights and idle (waiting for
        requests) between its last reply seen here and the one seen at the previous call."""
        delta = {}
        for k, v in self.stats.items():
            delta[k] = v - self.seen.get(k, 0.0)
        self.seen = dict(self.stats)
        return delta

    def release(self):
        pass  # the rollout rank keeps its weights: nothing here to free

    def move(self, layout):
        """--rebalance in process: after every reply due, tell the rollout rank where the ranks go."""
        self.collect()
        self._send(Move(layout, self.bucket_bytes))
        while self.sent:
            dist.wait_all(self.sent.popleft()[1])
        self.moved = True

    def close(self):
        """Collect what is still in flight, then tell the rollout rank to stop."""
        if self.moved:
            return
        try:
            self.collect()
            self._send(Stop())
            while self.sent:
                dist.wait_all(self.sent.popleft()[1])
        except RuntimeError:
            pass  # the rollout rank is already gone (it failed, or was stopped): nothing to tell it


def serve(plan, engine):
    """The rollout rank's loop.

    Consumes: one message from each trainer in `plan.served`, in that order, on the request
      group (they run the same loop, so they send the same sequence).
    Waits for: those messages; while the trainers train it has nothing to do (idle_s).
    Does, per kind of message:
      Weights: loads policy `version` from trainer 0's broadcast, bucket by bucket as each
        lands (the trainers send it only after taking every reply due): on the weight group
        into a native engine, or into a vLLM engine's worker over their transfer group, the
        rollout rank driving the engine's start/update/finish meanwhile;
      Generate: one batch per trainer (the batches a colocated engine would see), each
        answered to its trainer as soon as it is done: {"samples": Samples, "stats": seconds};
      Stop: leaves the loop (after a checkpoint: SIGTERM is ignored here, the trainers save
        first and then send Stop); Move: leaves it too, returning the Move (else None); Start
        (--stream): returns it, for roles/stream.py's loop.
    Produces: samples tagged with the policy version that made them, and its running seconds
      busy / sync / idle, which the trainers turn into placement metrics."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # Ctrl-C reaches every rank: the trainers stop this one
        signal.signal(sig, signal.SIG_IGN)
    stats = {"busy_s": 0.0, "sync_s": 0.0, "idle_s": 0.0}
    sent = []  # send handles of replies not yet known to have arrived
    bufs = {}  # bucket buffers, kept across syncs
    while True:
        t = time.perf_counter()
        try:
            msgs = [dist.recv_obj(r, plan.request_group) for r in plan.served]
        except RuntimeError:
            # a trainer went away (it stopped on a mistake, which it reports, or it died, which
            # torchrun reports): nothing left to serve, and no traceback to add to theirs
            leave(engine, f"rollout rank {plan.rank}: its trainers went away; stopping")
        stats["idle_s"] += time.perf_counter() - t
        kinds = {type(m) for m in msgs}
        if len(kinds) > 1:
            raise RuntimeError(f"trainers {plan.served} sent different messages {kinds}: they must run the "
                               "same loop")
        msg = msgs[0]
        if isinstance(msg, (Stop, Move, Start)):
            break
        t = time.perf_counter()
        if isinstance(msg, Weights):
            sent = dist.wait_all(sent)  # the trainers took every reply before announcing weights
            engine.version = msg.version
            receive(plan, engine, msg, bufs)
            stats["sync_s"] += time.perf_counter() - t
            continue
        for trainer, m in zip(plan.served, msgs):
            out = engine.generate(m.prompts, m.params, m.seeds)
            stats["busy_s"] += time.perf_counter() - t
            t = time.perf_counter()
            sent += dist.isend_obj({"samples": out, "stats": dict(stats)}, trainer)
    dist.wait_all(sent)
    return msg if isinstance(msg, (Move, Start)) else None


def leave(engine, why: str):
    """Stop this rollout rank at once, its engine first: vLLM's engine process would outlive it."""
    print(why, file=sys.stderr, flush=True)
    engine.close()
    dist.exit_now(1)


def receive(plan, engine, msg: Weights, bufs: dict):
    """One update from trainer 0's broadcast into this rollout rank's engine; if the broadcast breaks
    off, the rank stops with one line."""
    try:
        if hasattr(engine, "receive_weights") and not msg.adapters:  # a vLLM engine (perhaps in Episodes)
            engine.receive_weights(msg.specs)
            return
        weights = _incoming(plan, msg, bufs)
        if msg.adapters:
            engine.load_adapters(weights, msg.adapters)
        else:
            engine.load_weights(weights)
    except RuntimeError as e:
        leave(engine, f"rollout rank {plan.rank}: the weights of version {msg.version} broke off: trainer 0 "
                      f"died or hung; stopping ({str(e)[:300]})")


def receive_staged(plan, msg: Weights, bufs: dict) -> list:
    """--stream: one update from trainer 0's broadcast, copied out of the bucket buffers, to go into
    the engine later: [(hf_name, tensor)]."""
    return [(name, t.clone()) for name, t in _incoming(plan, msg, bufs)]


def _incoming(plan, msg: Weights, bufs: dict):
    """The (hf_name, tensor) stream of trainer 0's broadcast of `msg`, bucket by bucket (each tensor a
    view of a bucket buffer that the next bucket reuses)."""
    buckets = dist.plan_buckets(msg.specs, msg.bucket_bytes)
    shapes = {name: shape for name, shape, _ in msg.specs}
    return dist.receive_buckets(buckets, shapes, 0, plan.weight_group, plan.device, bufs)


def agree_on_transfer(plan, engine, specs, bucket_bytes: int):
    """disaggregate, once: the rollout ranks say how they take weights. A native engine takes
    trainer 0's torch broadcast over the weight group; a vLLM engine (its core in a child
    process) takes it through vLLM's weight-transfer layer, straight into its worker: trainer 0
    opens that group (gloo on CPU, vLLM's nccl on GPU), sends its rendezvous to the rollout
    ranks, and each rollout rank's worker joins as rank 1 + its index (engines/vllm_transfer.py)."""
    try:
        # every rank learns what the rollout ranks' engines take: LoRA's adapters alone (a native
        # engine merges them into the base it is sent once; a vLLM one serving adapters has its own base)
        kind = [(engine.takes_adapters, engine.has_base) if plan.rank == plan.layout.dp else None]
        torch.distributed.broadcast_object_list(kind, src=plan.layout.dp)
        if plan.role == "trainer":
            engine.takes_adapters, engine.has_base = kind[0]
        if plan.role == "trainer" and plan.rank != 0:
            return  # only trainer 0 sends weights
        _open_transfer(plan, engine, specs, bucket_bytes)
    except RuntimeError as e:
        if plan.role == "rollout":  # trainer 0 stopped (on a mistake it reports, or it died): nothing to add
            leave(engine, f"rollout rank {plan.rank}: trainer 0 went away before the first weights; stopping")
        raise RuntimeError(f"the rollout ranks stopped answering while the weight transfer was set up: one "
                           f"died or hung (see its output above). {errors.newest_checkpoint()} "
                           f"({str(e)[:200]})") from e


def _open_transfer(plan, engine, specs, bucket_bytes: int):
    said = [getattr(engine, "backend", None)]  # a rollout rank's vLLM engine names its backend
    torch.distributed.broadcast_object_list(said, src=plan.layout.dp, group=plan.weight_group)
    if said[0] is None:  # native engines: LoRA can send them the adapters alone
        return
    info = [None]
    if plan.rank == 0:
        from engines.vllm_transfer import TrainerEnd  # defers vllm

        end = TrainerEnd(said[0], specs, plan.layout.rollout_ranks, bucket_bytes, plan.timeout_s)
        info = [end.worker_info(0)]
    torch.distributed.broadcast_object_list(info, src=0, group=plan.weight_group)
    if plan.rank == 0:
        end.connect()  # returns once every rollout rank's worker has joined
        engine.transfer = end
    else:
        engine.join_transfer({**info[0], "rank_offset": 1 + plan.rank - plan.layout.dp})
