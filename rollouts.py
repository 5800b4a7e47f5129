"""How a step's scored samples are made: one object per way, chosen once before the loop (`choose`),
called once a step (`step`, which `make`s the step's RolloutResult and then releases the engine).

    OnPolicy         colocate (this rank's own engine, taking turns with training) and disaggregate
                     at --max-staleness 0 (its rollout rank, behind the same engine methods)
    Ahead            disaggregate at --max-staleness S >= 1: the prompts of up to S steps ahead go
                     out too, so the rollout ranks generate while this rank trains
    Streaming        disaggregate with --stream: the same prompts go to the rollout ranks' pools,
                     which stream each group back as it ends and take new weights in flight
    Streamed         partial: the sampler ranks generate and stream finished chunks to the judge
                     ranks, which judge them meanwhile (both halves and their messages are here)
    DynamicSampling  wraps one of those: DAPO's dynamic sampling in G-Core's waves
    ReMax            wraps one of those: the reward of each prompt's greedy completion as baseline

Every rank is the controller of its own prompts: it generates and scores them itself; no rank
gathers the batch. The rewards come from roles/reward.py `Scorer`.
"""
import math
import os
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from engines.base import Samples
from engines.decode import SamplingParams
from rl import algos
from roles.judge import judge_chunk
from roles.rollout import Start
from roles.stream import SNAPSHOT
from tasks.data import PromptStream, prompt_seed, step_prompts
from utils import checkpoint, dist
from utils.errors import check_rules

MAX = torch.distributed.ReduceOp.MAX
GROUP_BASELINES = ("grpo", "rloo", "reinforce++_baseline")  # advantage 0 when a group's rewards agree
# G-Core's dynamic-sampling constants (its DynamicSamplingRolloutGenerator's defaults): the running
# groups-per-informative-group ratio starts at 1, decays by 0.9 a step and is capped at 10
DS_INITIAL_EMA, DS_DECAY, DS_MAX_RATIO = 1.0, 0.9, 10.0


@dataclass
class DynamicSamplingArgs:
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling with G-Core's waves: a group whose rewards are all equal (no GRPO
    signal) is dropped, and each rank refills its own share in waves of ceil(gap * ema *
    --ds-oversampling) prompts until it holds its prompts-per-step / trainers informative groups or
    the refills run out; slots still empty are filled with dropped groups that leave the loss"""
    ds_oversampling: float = 1.2
    """--dynamic-sampling: draw this many times the prompts the running ratio says are needed"""
    ds_max_refills: int = 3
    """--dynamic-sampling: waves after the first, at most, per step"""
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        "ds_oversampling": ("dynamic_sampling", bool, "--dynamic-sampling"),
        "ds_max_refills": ("dynamic_sampling", bool, "--dynamic-sampling")}

    def check(self, args):
        check_rules(self, [
            ("dynamic_sampling", not self.dynamic_sampling or args.placement.max_staleness == 0
             or args.stream.stream,
             f"it decides each refill from the last wave's rewards, so it waits for each wave, and "
             f"--max-staleness {args.placement.max_staleness} sends the steps ahead: add --stream (a wave "
             f"then goes into the rollout ranks' running pool) or drop one of the two"),
            ("dynamic_sampling", not self.dynamic_sampling or args.advantage in GROUP_BASELINES,
             f"it drops groups whose rewards are all equal, which carry no signal only under a group "
             f"baseline (grpo, rloo, reinforce++_baseline), not --advantage {args.advantage}: drop one of "
             f"the two"),
            ("dynamic_sampling", not self.dynamic_sampling or not args.distill.alone(args.reward),
             "with distillation alone every reward is weighted 0, so every group would look alike and be "
             "dropped: drop --dynamic-sampling"),
            ("ds_oversampling", 0 < self.ds_oversampling < math.inf, "use a positive factor such as 1.2"),
            ("ds_max_refills", self.ds_max_refills >= 0, "use 0 (one wave) or more")])


@dataclass
class RolloutResult:
    """One step's samples on this rank: n per prompt, prompt-major (N = prompts * n)."""
    rows: list[dict]  # this rank's prompts, one per group (ids, prompt, answer, other columns)
    samples: Samples  # [N] completions with the engine's log-probs and the policy version
    rewards: torch.Tensor  # [N] (0 where failed)
    parts: dict  # {term: [N]} each reward term, the overlong penalty among them
    failed: torch.Tensor  # [N] bool: no reward
    scored: torch.Tensor  # [N] bool: has a reward (and, for ReMax, a baseline): it gets an advantage
    keep: torch.Tensor  # [N] bool: in the loss (scored, not padding, not cut off with --mask-truncated)
    baseline: torch.Tensor | None = None  # [N / n] ReMax: the reward of each prompt's greedy completion
    metrics: dict = field(default_factory=dict)  # the rollout's own rollout/ metrics (rank 0 logs them)
    tally: dict = field(default_factory=dict)  # sampler/judge busy seconds, judge verdicts (partial)


def new_tally() -> dict:
    return {"sampler_busy": 0.0, "judge_busy": 0.0, "judge_unparsed": 0, "judge_verdicts": 0}


class OnPolicy:
    """This rank's prompts of the step, generated by its engine with the weights of this step
    (colocate: its own engine; disaggregate: its rollout rank's), then scored."""

    def __init__(self, engine, scorer, rows: list[dict], args, plan):
        self.engine, self.scorer, self.rows, self.args, self.plan = engine, scorer, rows, args, plan
        self.n = args.num_generations
        overlong = getattr(args, "overlong", None)  # train_ppo.py has no --mask-truncated
        self.mask_truncated = bool(overlong and overlong.mask_truncated)
        self.sampling = args.sampling.params(self.n)

    def step(self, step: int, timer) -> RolloutResult:
        """The step's RolloutResult; the engine then gives its memory back to training (colocate)."""
        got = self.make(step, timer, new_tally())
        self.engine.release()
        return got

    def make(self, step: int, timer, tally) -> RolloutResult:
        args, plan = self.args, self.plan
        rows, seeds = step_prompts(self.rows, step, args.prompts_per_step, args.run_args.seed, plan.rank,
                                   plan.dp)
        out, judged = self.generate(rows, seeds, timer, tally)
        scores = self.scorer.score(rows, seeds, out, judged, self.n, timer, tally)  # [N], {term: [N]}, [N]
        return self.finish(rows, out, scores, torch.zeros(len(out.texts), dtype=torch.bool), tally)

    def generate(self, rows, seeds, timer, tally, step: int = 0, wave: int = 0):
        """(Samples, judge scores or None: the scorer judges them). step, wave: which (a stream's key)."""
        with timer("generate"):
            return self.engine.generate([r["ids"] for r in rows], self.sampling, seeds), None

    def finish(self, rows, out, scores, padded, tally) -> RolloutResult:
        """A sample without a reward (or, with --mask-truncated, cut off at the length limit, or
        a dynamic-sampling padding group) is left out of the loss."""
        rewards, parts, failed = scores
        keep = ~failed & ~padded
        if self.mask_truncated:
            keep = keep & torch.tensor([r != "length" for r in out.finish_reasons])
        return RolloutResult(rows, out, rewards, parts, failed, ~failed, keep, tally=tally)

    def saved(self) -> tuple[dict, dict]:
        """What checkpoints carry of this component: (meta.json extras, this rank's own)."""
        return {}, {}


class Ahead(OnPolicy):
    """disaggregate, --max-staleness S >= 1: the prompts of steps up to S ahead are sent too, so
    that the rollout ranks generate them while this rank trains; their samples are then up to S
    versions old, and the ratio to the engine's log-probs corrects for it."""

    def __init__(self, engine, scorer, rows, args, plan):
        super().__init__(engine, scorer, rows, args, plan)
        self.in_flight = {}  # step -> (this rank's rows, seeds, ticket)
        self.submitted = None  # the next step whose prompts go out

    def make(self, step: int, timer, tally) -> RolloutResult:
        args = self.args
        if self.submitted is None:
            self.submitted = step
        with timer("generate"):
            while self.submitted <= min(step + args.placement.max_staleness, args.steps - 1):
                ahead, seeds = step_prompts(self.rows, self.submitted, args.prompts_per_step,
                                            args.run_args.seed, self.plan.rank, self.plan.dp)
                self.in_flight[self.submitted] = ahead, seeds, self.send(self.submitted, ahead, seeds)
                self.submitted += 1
            rows, seeds, ticket = self.in_flight.pop(step)
            out = self.take(step, rows, ticket)
        scores = self.scorer.score(rows, seeds, out, None, self.n, timer, tally)
        return self.finish(rows, out, scores, torch.zeros(len(out.texts), dtype=torch.bool), tally)

    def send(self, step: int, rows: list[dict], seeds: list[int]):
        """A step's prompts out to the rollout rank; returns what `take` needs (the engine's ticket)."""
        return self.engine.submit([r["ids"] for r in rows], self.sampling, seeds)

    def take(self, step: int, rows: list[dict], ticket) -> Samples:
        return self.engine.result(ticket)


class Streaming(Ahead):
    """disaggregate, --stream: the prompts of the steps up to --max-staleness ahead go to the rollout
    rank's pool (roles/stream.py), which streams each group back as it ends; a step takes its own
    groups once they are all in. Its tokens carry their versions (Samples.token_versions); a
    checkpoint is complete once every rollout rank has written what it had in flight into it."""

    def __init__(self, engine, scorer, rows, args, plan, resumed: dict):
        super().__init__(engine, scorer, rows, args, plan)
        done = resumed.get("step", 0)
        snapshot = None
        if done:  # (a checkpoint of a run without --stream has none: the pool starts empty)
            snapshot = os.path.join(checkpoint.checkpoint_dir(args.run_args.run_dir, done),
                                    SNAPSHOT.format(rank=plan.rollout_peer))
            snapshot = snapshot if os.path.isfile(snapshot) else None
        engine.start_stream(Start(
            self.sampling, args.placement.max_staleness, args.steps, args.prompts_per_step // plan.dp,
            max(len(r["ids"]) for r in rows) + args.sampling.max_new_tokens, args.stream.stream_rows,
            args.stream.partial_rollout_drop, args.stream.stream_swap, args.run_args.run_dir, snapshot, done))

    def send(self, step: int, rows: list[dict], seeds: list[int]):
        self.engine.submit_groups(step, 0, [r["ids"] for r in rows], seeds)

    def take(self, step: int, rows: list[dict], ticket) -> Samples:
        return self.engine.take_groups(step, 0, len(rows))

    def generate(self, rows, seeds, timer, tally, step: int = 0, wave: int = 0):
        """--dynamic-sampling's waves: each one sent, then its groups awaited."""
        with timer("generate"):
            self.engine.submit_groups(step, wave, [r["ids"] for r in rows], seeds)
            return self.engine.take_groups(step, wave, len(rows)), None

    def saved(self) -> tuple[dict, dict]:
        """The checkpoint awaits each rollout rank's snapshot (utils/checkpoint.py is_complete)."""
        ranks = range(self.plan.layout.dp, self.plan.layout.world)
        return {"awaits": [SNAPSHOT.format(rank=r) for r in ranks]}, {}


class Streamed(OnPolicy):
    """partial: this rank's samples of its own prompts, and their judge scores, made on the way:
    the sampler ranks generate while the judge ranks judge finished chunks (`sample_and_stream`
    and `judge_stream` below, at the same time)."""

    def __init__(self, engine, scorer, rows, args, plan, judge):
        super().__init__(engine, scorer, rows, args, plan)
        self.judge = judge  # only the judge ranks hold it

    def generate(self, rows, seeds, timer, tally, step: int = 0, wave: int = 0):
        with timer("generate"):
            if self.plan.is_sampler:
                out, judged, busy = sample_and_stream(self.plan, self.engine, rows, seeds, self.sampling,
                                                      self.args.judge.judge_chunk)
                tally["sampler_busy"] += busy
                return out, judged
            out, judged, busy, count, unparsed = judge_stream(self.plan, self.judge, rows, seeds, self.n)
            tally["judge_busy"] += busy
            tally["judge_unparsed"] += unparsed
            tally["judge_verdicts"] += self.args.judge.judge_samples * count
            return out, judged


class DynamicSampling:
    """DAPO's dynamic sampling in G-Core's waves, on this rank's own share (no rank gathers the
    batch), around any of the above. Each wave draws ceil(gap * ema * --ds-oversampling) prompts
    for this rank's `gap` missing informative groups (rewards not all equal), from its own prompt
    stream (prompts put back first); the waves go on while any rank has a gap (one max-reduce a
    wave), at most 1 + --ds-max-refills of them, so every rank runs the same number; a rank
    without a gap sends an empty wave. Slots still empty are filled with uninformative groups,
    padding, which leaves the loss: every rank trains prompts_per_step / trainers groups.
    Informative groups beyond the target put their prompt back. Samples are seeded per (seed,
    step, wave, position in the wave). The stream and the ema are in checkpoints (`saved`)."""

    def __init__(self, inner: OnPolicy, resumed: dict):
        self.inner, self.args, self.plan = inner, inner.args, inner.plan
        self.stream = PromptStream(len(inner.rows), self.args.run_args.seed, self.plan.rank, self.plan.dp)
        if "stream" in resumed.get("rank_state", {}):
            self.stream.load(resumed["rank_state"]["stream"])
        self.ema = resumed.get("ds_ema", DS_INITIAL_EMA)

    def step(self, step: int, timer) -> RolloutResult:
        got = self.make(step, timer, new_tally())
        self.inner.engine.release()
        return got

    def make(self, step: int, timer, tally) -> RolloutResult:
        inner, args, plan = self.inner, self.args, self.plan
        n, target = inner.n, args.prompts_per_step // plan.dp
        drawn, outs, scores = [], [], []  # per wave: row indices, Samples, (rewards, parts, failed)
        informative = []  # per group drawn, in order
        waves = 0
        for wave in range(1 + args.dynamic_sampling.ds_max_refills):
            gap = target - min(target, sum(informative))
            if dist.reduce({"gap": gap}, op=MAX, group=plan.trainer_group)["gap"] == 0:
                break
            picked = self.stream.take(algos.wave_size(gap, self.ema, args.dynamic_sampling.ds_oversampling))
            wave_rows = [inner.rows[i] for i in picked]
            seeds = [prompt_seed(args.run_args.seed, step, plan.rank + i * plan.dp, wave)
                     for i in range(len(picked))]
            out, judged = inner.generate(wave_rows, seeds, timer, tally, step, wave)
            waves += 1
            # this rank's share is full: it only took part (a remote engine expects every rank)
            if not picked:
                continue
            # [k * n] each
            rewards, parts, failed = inner.scorer.score(wave_rows, seeds, out, judged, n, timer, tally)
            informative += algos.informative_groups(rewards.view(-1, n), (~failed).view(-1, n)).tolist()
            drawn.append(picked)
            outs.append(out)
            scores.append((rewards, parts, failed))
        # the step's groups: informative ones first (in draw order) up to the target, then padding
        flat = [i for picked in drawn for i in picked]
        good = [g for g, ok in enumerate(informative) if ok]
        bad = [g for g, ok in enumerate(informative) if not ok]
        chosen = good[:target] + bad[:target - len(good[:target])]
        self.stream.put_back([flat[g] for g in good[target:]])
        out = Samples.cat(outs)
        sample_rows = [g * n + j for g in chosen for j in range(n)]
        rewards = torch.cat([r for r, _, _ in scores])[sample_rows]
        failed = torch.cat([f for _, _, f in scores])[sample_rows]
        parts = {}
        for name in scores[0][1]:
            parts[name] = torch.cat([p[name] for _, p, _ in scores])[sample_rows]
        padded = torch.tensor([not informative[g] for g in chosen]).repeat_interleave(n)  # [N]
        kept_tokens = out.lengths[sample_rows][~padded].sum()
        counts = dist.reduce(group=plan.trainer_group, values={
            "generated": len(informative), "informative": sum(informative), "kept": len(good[:target]),
            "padded": int(padded.sum()) // n, "unused_tokens": out.lengths.sum() - kept_tokens})
        self.ema = algos.sampling_ema(self.ema, counts["generated"], counts["informative"], DS_DECAY,
                                      DS_MAX_RATIO)
        rows = [inner.rows[flat[g]] for g in chosen]
        got = inner.finish(rows, out.take(sample_rows), (rewards, parts, failed), padded, tally)
        got.metrics = {
            "rollout/ds_waves": waves, "rollout/ds_groups_generated": counts["generated"],
            "rollout/ds_groups_informative": counts["informative"], "rollout/ds_groups_kept": counts["kept"],
            "rollout/ds_groups_padded": counts["padded"], "rollout/ds_unused_tokens": counts["unused_tokens"],
            "rollout/ds_ema": self.ema}
        return got

    def saved(self) -> tuple[dict, dict]:
        extra, mine = self.inner.saved()  # (--stream: the rollout ranks' snapshots the checkpoint awaits)
        return {**extra, "ds_ema": self.ema}, {**mine, "stream": self.stream.state()}


class ReMax:
    """ReMax's baseline (Li et al. 2023) around any of the above: one greedy completion per prompt
    of this rank, scored like the samples; a sample whose prompt's baseline failed gets no
    advantage."""

    def __init__(self, inner: OnPolicy):
        self.inner = inner
        self.greedy = SamplingParams(1, 0.0, 1.0, 0, inner.args.sampling.max_new_tokens)

    def step(self, step: int, timer) -> RolloutResult:
        got = self.make(step, timer, new_tally())
        self.inner.engine.release()
        return got

    def make(self, step: int, timer, tally) -> RolloutResult:
        inner, plan = self.inner, self.inner.plan
        got = inner.make(step, timer, tally)
        seeds = [prompt_seed(inner.args.run_args.seed, step, plan.rank + i * plan.dp)
                 for i in range(len(got.rows))]
        with timer("generate"):
            out = inner.engine.generate([r["ids"] for r in got.rows], self.greedy, seeds)
        got.baseline, _, failed = inner.scorer.score(got.rows, seeds, out, None, 1, timer, tally)  # [G] each
        got.scored = got.scored & ~failed.repeat_interleave(inner.n)  # no baseline, no advantage
        got.keep = got.keep & got.scored
        return got

    def saved(self) -> tuple[dict, dict]:
        return self.inner.saved()


def choose(engine, scorer, rows: list[dict], args, plan, judge, resumed: dict):
    """train_grpo.py's rollout for its flags: the placement's own, wrapped by --dynamic-sampling or
    --advantage remax when asked (check_args refuses the combinations that cannot work)."""
    if plan.mode == "partial":
        rollout = Streamed(engine, scorer, rows, args, plan, judge)
    elif args.stream.stream:
        rollout = Streaming(engine, scorer, rows, args, plan, resumed)
    elif args.placement.max_staleness:
        rollout = Ahead(engine, scorer, rows, args, plan)
    else:
        rollout = OnPolicy(engine, scorer, rows, args, plan)
    if args.dynamic_sampling.dynamic_sampling:
        rollout = DynamicSampling(rollout, resumed)
    if args.advantage == "remax":
        rollout = ReMax(rollout)
    return rollout
# ---- partial placement: the sampler ranks' half and the judge ranks' half of one rollout, and their messages

@dataclass
class Prompts:
    """A judge rank's own prompts of this wave, sent to the sampler that generates them."""
    ids: list[list[int]]
    seeds: list[int]


@dataclass
class Chunk:
    """Samples of up to --judge-chunk of `owner`'s prompts, on their way to its judge; `rows`
    (prompt text and dataset columns, for the judge's template) travel only for a sampler's
    own prompts: a judge rank has its own. `last`: the owner's final chunk of this wave."""
    owner: int
    rows: list[dict]
    seeds: list[int]
    samples: Samples
    last: bool


def sample_and_stream(plan, engine, rows, seeds, params, chunk: int):
    """A sampler rank's part of one partial-placement rollout (`judge_stream` is
    the other part, on the judge ranks, at the same time).

    Consumes: a `Prompts` message from each judge rank it generates for (those with
      plan.layout.sampler_of(j) == this rank), then its own `rows` and `seeds`.
    Does: generates its own prompts, then theirs, `chunk` prompts at a time, and sends each
      finished chunk at once (non-blocking) to a judge, so that judging overlaps the rest of
      the generation: its own chunks dealt in turn among `judges_of(this rank)` (each of them
      gets at least an empty one, whose `last` closes its stream), a judge rank's to itself.
    Waits for: the judges' scores of its own chunks, after the last chunk is sent.
    Produces: (its own Samples, their judge scores [N], busy seconds generating)."""
    layout, me = plan.layout, plan.rank
    judges = layout.judges_of(me)
    ids = [r["ids"] for r in rows]
    starts = list(range(0, len(ids), chunk))
    count = max(len(starts), len(judges))  # own chunks sent, empty ones included
    sent, mine, busy = [], [], 0.0
    for k in range(count):
        out, part, part_seeds = Samples.empty(engine.version), [], []
        if k < len(starts):
            part, part_seeds = rows[starts[k]:starts[k] + chunk], seeds[starts[k]:starts[k] + chunk]
            t = time.perf_counter()
            out = engine.generate(ids[starts[k]:starts[k] + chunk], params, part_seeds)
            busy += time.perf_counter() - t
        last = k + len(judges) >= count  # this judge's final chunk of this share
        sent += dist.isend_obj(Chunk(me, part, part_seeds, out, last), judges[k % len(judges)])
        mine.append(out)
    for j in range(layout.sampler_ranks, layout.world):  # the judge ranks' prompts, each back to its owner
        if layout.sampler_of(j) != me:
            continue
        msg = dist.recv_or_fail(j, "its judge rank's prompts")
        for k in range(0, max(1, len(msg.ids)), chunk):  # an empty share still sends its (empty) last chunk
            t = time.perf_counter()
            out = engine.generate(msg.ids[k:k + chunk], params, msg.seeds[k:k + chunk])
            busy += time.perf_counter() - t
            sent += dist.isend_obj(Chunk(j, [], msg.seeds[k:k + chunk], out, k + chunk >= len(msg.ids)), j)
    judged = []
    for k in range(count):
        judged.append(dist.recv_or_fail(judges[k % len(judges)], "the judge's scores"))
    dist.wait_all(sent)
    return Samples.cat(mine), torch.cat(judged), busy


def judge_stream(plan, judge, rows, seeds, n: int):
    """A judge rank's part of one partial-placement rollout (`sample_and_stream`
    is the other part, on the sampler ranks, at the same time).

    Sends: its own prompts (`rows`, `seeds`) to its sampler, first.
    Consumes: `Chunk`s from each sampler, in that sampler's send order: the sampler's own
      prompts' chunks dealt to this rank (when it is among `judges_of` the sampler), then this
      rank's own; each stream ends with a chunk marked `last`.
    Does: judges each chunk as it lands (the judge's weights loaded for the rollout, released
      after it, as a colocated engine's are) and sends a sampler's scores straight back.
    Produces: (its own Samples, their judge scores [N], busy seconds judging, the completions it
      judged and their unparsed verdicts)."""
    layout, me = plan.layout, plan.rank
    sent = dist.isend_obj(Prompts([r["ids"] for r in rows], seeds), layout.sampler_of(me))
    judge.load()
    mine, scores, busy, taken = [], [], 0.0, 0
    judged_count, unparsed = 0, 0
    for sampler in range(layout.sampler_ranks):
        owners = []
        if me in layout.judges_of(sampler):
            owners.append(sampler)
        if layout.sampler_of(me) == sampler:
            owners.append(me)
        for owner in owners:
            while True:
                chunk = dist.recv_or_fail(sampler, "its sampler's samples")
                t = time.perf_counter()
                chunk_rows = chunk.rows
                if owner == me:
                    chunk_rows = rows[taken:taken + len(chunk.seeds)]
                    taken += len(chunk.seeds)
                judged, missed = judge_chunk(judge, chunk_rows, chunk.seeds, chunk.samples, n)
                busy += time.perf_counter() - t
                judged_count += len(judged)
                unparsed += missed
                if owner == me:
                    mine.append(chunk.samples)
                    scores.append(judged)
                else:
                    sent += dist.isend_obj(judged, owner)
                if chunk.last:
                    break
    judge.release()
    dist.wait_all(sent)
    return Samples.cat(mine), torch.cat(scores), busy, judged_count, unparsed
