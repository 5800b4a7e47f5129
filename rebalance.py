"""Dynamic placement (--rebalance): move ranks between training and generation as the run goes.

`decide` is the pure decision, from the reduced busy seconds of the last steps (the same numbers
on every trainer, so every rank decides alike with no message). `Rebalancer` is the component
the step loop calls once a step (`after_step`); with --rebalance off it does nothing. A move is
a checkpoint (a crash during the move resumes from it) and the new layout written to
run_dir/placement.json, then, in process (`move`): the trainers tell their rollout ranks, every
rank builds the new layout's groups and trainer mesh (placement.replan), the trainers' state
moves onto it in memory (placement.reshard), and each rank goes on in its new role: the script
builds the roles again (frozen models from their checkpoints) and restores the moved state in
place of a checkpoint; a rollout rank that stays one keeps its engine. The first step checks
that a digest of the full weights, Adam's moments and the LR is the one the move left with.
--rebalance-restart moves by a restart instead (every rank exits with MOVE_EXIT, torchrun
restarts them, they read the layout back and resume from the move's checkpoint): the fallback,
and the only way with vLLM rollout engines.
"""
import json
import os
import signal
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

import placement
from engines.make import engine_kind
from placement import Layout
from utils import checkpoint, dist
from utils.errors import UserError, check_rules

MOVES = "placement.json"  # in run_dir: the layout --rebalance moved to, and each move's numbers
MOVE_EXIT = 3  # --rebalance-restart: a rank's exit code after a move; torchrun starts the new layout
PAUSE = "RL_TEST_MOVE_PAUSE_S"  # a test hook: seconds each rank waits in a move in process, once saved
MAX = torch.distributed.ReduceOp.MAX
MOVE_PARTS = ("digest_s", "checkpoint_s", "agree_s", "groups_s", "state_s", "state_bytes")  # a move's parts


@dataclass
class RebalanceArgs:
    rebalance: bool = False
    """disaggregate: move ranks between training and generation as the run goes, when the measured
    busy seconds predict a faster split that pays for the move (rebalance.decide); a move saves a
    checkpoint and goes on in process, the training state moved onto the new trainer mesh"""
    rebalance_restart: bool = False
    """--rebalance: move by a restart instead: every rank exits after the move's checkpoint and torchrun
    restarts them in the new layout (launch with --max-restarts: one per move, plus those for
    failures); the fallback, and the only way with vLLM rollout engines"""
    rebalance_threshold: float = 0.1
    """--rebalance: move only to a split predicted faster by this share of a step"""
    rebalance_window: int = 10
    """--rebalance: the steps whose mean busy seconds a decision reads"""
    rebalance_gap: int = 20
    """--rebalance: steps at least between two moves (and from the start); the horizon a move must
    pay for itself in"""
    rebalance_force: tuple[int, ...] = ()
    """--rebalance, a test hook: STEP K [STEP K ...] moves to K rollout ranks after STEP steps, whatever
    the measurements say"""
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        "rebalance_threshold": ("rebalance", bool, "--rebalance"),
        "rebalance_window": ("rebalance", bool, "--rebalance"),
        "rebalance_gap": ("rebalance", bool, "--rebalance")}

    def check(self, args, world: int, layout: Layout):
        check_rules(self, [
            ("rebalance", not self.rebalance or args.placement.placement in ("disaggregate", "partial"),
             "it moves ranks between roles, and --placement colocate gives every rank every role: add "
             "--placement disaggregate --rollout-ranks K (trainers and rollout ranks) or --placement partial "
             "(samplers and judges)"),
            ("rebalance", not self.rebalance or not args.dynamic_sampling.dynamic_sampling,
             "it cannot run with --dynamic-sampling, whose prompt stream per trainer a move would split "
             "differently: drop one of the two"),
            ("rebalance_restart", not self.rebalance_restart or self.rebalance,
             "it makes each --rebalance move a restart, and --rebalance is off: add --rebalance, or drop "
             "--rebalance-restart"),
            ("rebalance_restart", not self.rebalance_restart or args.placement.placement != "partial",
             "partial placement moves in process only (every rank trains: the state stays on its ranks): "
             "drop --rebalance-restart"),
            ("rebalance_restart", not self.rebalance_restart
             or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) >= 1,
             "each move restarts the workers in the new layout, and torchrun was launched without restarts: "
             "launch with torchrun --max-restarts N (one per move you allow, plus those for failures)"),
            ("rebalance", not self.rebalance or self.rebalance_restart or engine_kind(
                args.sampling.engine, "cuda" if torch.cuda.is_available() else "cpu") == "native",
             "a move in process keeps native rollout engines only (a vLLM one would join a new weight-"
             "transfer group, not tried): add --rebalance-restart, or --engine native"),
            ("rebalance_threshold", 0 <= self.rebalance_threshold < 1,
             "use a share of a step in [0, 1), such as 0.1"),
            ("rebalance_window", self.rebalance_window >= 1, "use 1 or more steps"),
            ("rebalance_gap", self.rebalance_gap >= self.rebalance_window,
             f"a decision reads only the steps since the last move: use at least --rebalance-window "
             f"({self.rebalance_window})"),
            ("rebalance_force", not self.rebalance_force or self.rebalance,
             "it forces a --rebalance move, and --rebalance is off: add --rebalance"),
            ("rebalance_force", len(self.rebalance_force) % 2 == 0,
             "its numbers come two by two: use pairs STEP K")])
        now = side(layout)
        for step, k in zip(self.rebalance_force[::2], self.rebalance_force[1::2]):
            fits = [side(c) for c in splits(world, args.prompts_per_step, args.placement.max_staleness,
                                            layout.mode) if side(c) != now]
            if k not in fits:
                raise UserError(f"--rebalance-force {step} {k}: a world of {world} can move from "
                                f"{now} {ranks(layout)} to {fits or 'none other'}")
            now = k


@dataclass
class Move:
    """A rebalancing decision: the layout to move to (None: stay) and the numbers behind it."""
    layout: Layout | None
    why: str
    step_s: float = 0.0  # the window's mean step time now
    predicted_s: float = 0.0  # the best other layout's predicted step time
    gain_s: float = 0.0  # predicted seconds saved over the horizon, less the move's cost


def side(layout: Layout) -> int:
    """What a move changes: the rollout ranks K (disaggregate), the sampler ranks S (partial)."""
    return layout.sampler_ranks if layout.mode == "partial" else layout.rollout_ranks


def ranks(layout: Layout) -> str:
    return "sampler ranks" if layout.mode == "partial" else "rollout ranks"


def splits(world: int, prompts_per_step: int, max_staleness: int, mode: str = "disaggregate") -> list[Layout]:
    """Every layout of `world` ranks in `mode` that `placement.layout_of` accepts for this batch."""
    fits = []
    for k in range(1, world):
        try:
            if mode == "partial":
                fits.append(placement.layout_of(mode, world, prompts_per_step, 0, max_staleness,
                                                sampler_ranks=k))
            else:
                fits.append(placement.layout_of(mode, world, prompts_per_step, k, max_staleness))
        except UserError:
            continue
    return fits


def decide(window: list[dict], layout: Layout, fits: list[Layout], max_staleness: int,
           move_cost_s: float, horizon: int, threshold: float, since_move: int, min_gap: int) -> Move:
    """Where the ranks should be, from the last steps' reduced timings. Disaggregate: a trainer
    rank's busy seconds per step (`trainer_busy`, its mean over the trainers) times dp is the
    training work, a rollout rank's (`rollout_busy`) times K the generation work; another split
    T' + K' = N runs the same work in max(train / T', generate / K') per step when the two sides
    overlap (--max-staleness >= 1) and in their sum when they take turns (0). Moves when the best
    split of `fits` (`splits`, less what the script refuses) is predicted faster by more than
    `threshold` (a share of the step) and saves more than `move_cost_s` over the next `horizon`
    steps; else stays, saying why. Never within `min_gap` steps of the last move (`since_move`
    steps ago), so that a move's own disturbance cannot trigger the next one. Partial: the
    samplers' busy seconds (`sampler_busy`, summed over them) are the generation work and the
    judges' (`judge_busy`) the judging work; they stream side by side, so the rollout takes the
    slower side's share, max(generate / S, judge / G), and S' + G' = N changes only that part of
    the step (G-Core's partial colocation lives or dies by this split).
    window: [{"trainer_busy", "rollout_busy", "sampler_busy", "judge_busy", "step_s"}] per step."""
    if layout.mode not in ("disaggregate", "partial"):
        return Move(None, f"{layout.mode} placement has no ranks to move")
    if since_move < min_gap:
        return Move(None, f"{since_move} steps since the last move, under the minimum gap of {min_gap}")
    mean = lambda key: sum(w[key] for w in window) / len(window)  # noqa: E731
    step_s = mean("step_s")
    if layout.mode == "partial":
        generate, judge = mean("sampler_busy"), mean("judge_busy")  # rank-seconds per step
        rest = step_s - max(generate / layout.sampler_ranks, judge / layout.judge)
        predicted = lambda c: rest + max(generate / c.sampler_ranks, judge / c.judge)  # noqa: E731
    else:
        train = mean("trainer_busy") * layout.dp  # trainer-seconds per step
        generate = mean("rollout_busy") * layout.rollout_ranks  # rollout-rank-seconds per step
        sides = lambda c: (train / c.dp, generate / c.rollout_ranks)  # noqa: E731
        predicted = lambda c: max(sides(c)) if max_staleness else sum(sides(c))  # noqa: E731
    best = min((c for c in fits if side(c) != side(layout)), key=predicted, default=None)
    if best is None:
        return Move(None, "no other split fits the world and the batch", step_s)
    faster = step_s - predicted(best)
    gain = faster * horizon - move_cost_s
    move = Move(None, "", step_s, predicted(best), gain)
    if faster < threshold * step_s:
        move.why = (f"{side(best)} {ranks(best)} would save {faster / step_s:.0%} of a step, under the "
                    f"threshold {threshold:.0%}")
    elif gain <= 0:
        move.why = (f"the move costs {move_cost_s:.0f}s, more than the {faster * horizon:.0f}s it saves over "
                    f"{horizon} steps")
    else:
        move.layout, move.why = best, (f"{side(layout)} -> {side(best)} {ranks(best)}: {step_s:.2f}s -> "
                                       f"{predicted(best):.2f}s per step predicted")
    return move


def window_entry(total: dict, peak: dict, plan) -> dict:
    """A step's row of the window `decide` reads, from its reduced sums and maxima (run.reduce_step):
    each side's busy seconds per rank (partial: summed over its ranks) and the step's."""
    return {"trainer_busy": total["trainer_busy"] / plan.dp, "rollout_busy": total["rollout_busy"] / plan.dp,
            "sampler_busy": total.get("sampler_busy", 0.0), "judge_busy": total.get("judge_busy", 0.0),
            "step_s": peak["step_s"]}


def moves(run_dir: str) -> dict:
    """{"rollout_ranks": K (or "sampler_ranks": S), "moves": [...]} as the last move left it ({} before
    any)."""
    path = os.path.join(run_dir, MOVES)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def record_move(run_dir: str, record: dict):
    """Rank 0, after the move's checkpoint is complete: the new layout, written whole (a rename)."""
    state = moves(run_dir)
    key = "sampler_ranks" if record["mode"] == "partial" else "rollout_ranks"
    state = {key: record["to"], "moves": [*state.get("moves", []), record]}
    tmp = os.path.join(run_dir, MOVES + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, os.path.join(run_dir, MOVES))


@dataclass
class Arrival:
    """Where a layout's run starts: the moves so far (placement.json, {} before any) and the time
    the last one was decided (before any, the launch). After a move in process also: the state it
    carried onto this rank (`carried`, for run.Run in place of a checkpoint), its seconds so far
    (`timings`, and `left`: when the state had moved), rank 0's logger, and a rollout rank's engine."""
    run_dir: str
    moves: dict
    since: float
    carried: dict | None = None  # run.Run takes it (and drops it here: no copy outlives the restore)
    timings: dict = field(default_factory=dict)
    left: float = 0.0
    log: object = None
    engine: object = None
    in_process: bool = False  # this layout began with a move in process


def arrive(args, launched: float) -> Arrival:
    """Before the process group: a launch that torchrun restarted after a move (or --resume auto)
    takes the layout the move wrote (args.placement.rollout_ranks or sampler_ranks)."""
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    moved = {}
    if args.rebalance.rebalance and (restarted or args.run_args.resume == "auto"):
        moved = moves(args.run_args.run_dir)
    for key in ("rollout_ranks", "sampler_ranks"):
        if key in moved:
            setattr(args.placement, key, moved[key])
    return Arrival(args.run_args.run_dir, moved, moved["moves"][-1]["at"] if moved else launched)


def move(old, layout: Layout, state: dict | None, bucket_bytes: int, arrival: Arrival,
         timings: dict) -> tuple:
    """A move in process, on every rank (trainers from `Rebalancer.next_layout`, rollout ranks from
    their loop, told by their trainers): the new layout's groups and mesh, then the trainers'
    `state` (old trainers: {"state": checkpoint.state, "meta"}) onto the new trainers. Returns the
    new Plan and its Arrival.

    The move's checkpoint is saved by now, so a SIGTERM during the move (torchrun's, after another
    rank died; or a preemption) ends the rank at once, and `--resume auto` goes on from that
    checkpoint. A handler would run only once the collective it is blocked in returns, which one with
    a dead peer may not do before torchrun's 30 s grace ends in SIGKILL."""
    handler = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        if os.environ.get(PAUSE):
            time.sleep(float(os.environ[PAUSE]))
        t = time.perf_counter()
        new = placement.replan(old, layout)
        timings["groups_s"] = time.perf_counter() - t
        carried, stats = placement.reshard(old, new, state, bucket_bytes)
    finally:
        signal.signal(signal.SIGTERM, handler)
    moved = moves(arrival.run_dir)
    return new, Arrival(arrival.run_dir, moved, moved["moves"][-1]["at"], carried, {**timings, **stats},
                        time.time(), arrival.log, in_process=True)


class Rebalancer:
    """--rebalance in the step loop: `after_step` keeps the window of reduced busy seconds, asks
    `decide` and makes the move; `next_layout` then moves the state. Off, it does nothing.
    `exit_code`: 0, MOVE_EXIT after a move by restart, None after a move in process."""

    def __init__(self, args, plan, actor, arrival: Arrival, start: int, log, saved=None, engine=None):
        """saved(): what the move's checkpoint carries of the other components (the rollout's state);
        engine: the trainer's RemoteEngine, which tells its rollout rank of a move."""
        self.args, self.cfg, self.plan, self.actor, self.log = args, args.rebalance, plan, actor, log
        self.saved, self.engine = saved or (lambda: ({}, {})), engine
        self.window, self.since_move, self.warned, self.exit_code = [], 0, False, 0
        self.cost_s, self.target, self.step, self.timings = 0.0, None, 0, {}
        if self.cfg.rebalance:
            self.cost_s = self._arrived(arrival, start)

    def _arrived(self, arrival: Arrival, start: int) -> float:
        """Before the first step: the seconds a move costs (the last move's, measured from its
        decision to here; before any, this launch's start-up), the same on every trainer. Right
        after a move, the training state must be the one it left with, exactly (a digest of it)."""
        last = arrival.moves["moves"][-1] if arrival.moves else None
        group = self.plan.trainer_group
        cost_s = dist.reduce({"s": time.time() - arrival.since}, op=MAX, group=group)["s"]
        rebuild_s = time.time() - arrival.left
        if last and last["step"] == start:
            if checkpoint.digest(self.actor) != last["digest"]:
                raise RuntimeError(f"the move after step {start} did not carry the training state exactly "
                                   f"(its digest differs): a bug; "
                                   f"{checkpoint.last_complete(self.args.run_args.run_dir)}")
            timings = {}
            if arrival.in_process:  # where the seconds went (the slowest rank's)
                timings = {k: arrival.timings.get(k, 0.0) for k in MOVE_PARTS}  # a joiner had no checkpoint
                timings["rebuild_s"] = rebuild_s
                timings = dist.reduce(timings, op=MAX, group=group)
            if self.plan.rank == 0:
                self.log.log(start - 1, {"event": "placement/moved", "placement/move_s": cost_s,
                                         "placement/move_state_equal": 1.0,
                                         "placement/move_in_process": float(arrival.in_process),
                                         **{f"placement/move_{k}": v for k, v in timings.items()},
                                         f"placement/{ranks(self.plan.layout).replace(' ', '_')}":
                                             side(self.plan.layout)})
        return cost_s

    def after_step(self, step: int, entry: dict) -> bool:
        """After step `step` (0-based), from its reduced busy seconds `entry`: True when the ranks
        move (every rank then leaves the loop)."""
        if not self.cfg.rebalance:
            return False
        self.window.append(entry)
        self.since_move += 1
        move = self._decide(step)
        restart = self.cfg.rebalance_restart
        restarts_left = 1
        if restart:
            restarts_left = int(os.environ["TORCHELASTIC_MAX_RESTARTS"]) - int(
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if move.layout is not None and restarts_left < 1:
            if self.plan.rank == 0 and not self.warned:
                print(f"rebalance after step {step + 1}: {move.why}; not moving: torchrun has no restart "
                      f"left (--max-restarts used up)", flush=True)
            self.warned = True
            return False
        t = time.perf_counter()
        if move.layout is None or not self._move(step, move, self.saved()):
            return False
        self.timings["checkpoint_s"] = time.perf_counter() - t - self.timings["digest_s"]
        how, to = "torchrun restarts them" if restart else "in process", move.layout
        if self.plan.rank == 0:
            print(f"moving to {side(to)} {ranks(to)} of {to.world} ({how}), from step {step + 2}", flush=True)
        if restart:
            self.exit_code = MOVE_EXIT
            return True
        t = time.perf_counter()
        if self.plan.mode == "disaggregate":
            self.engine.move(move.layout)  # the rollout ranks leave their loop for the move
        self.timings["agree_s"] = time.perf_counter() - t
        self.exit_code, self.target, self.step = None, move.layout, step
        return True

    def next_layout(self, actor, saved: tuple, arrival: Arrival, log) -> tuple:
        """After a move in process (the loop left): every rank moves (`move`), this trainer's state
        with it. Returns the new Plan and its Arrival."""
        meta = {"step": self.step + 1, "scheduler": actor.sched.state_dict(), **saved[0]}
        arrival.log = log
        new, arrived = move(self.plan, self.target, {"state": checkpoint.state(actor), "meta": meta},
                            int(self.args.placement.sync_bucket_mb * 2**20), arrival, self.timings)
        if arrived.carried is not None:
            arrived.carried["rank_state"] = saved[1]
        return new, arrived

    def _decide(self, step: int) -> Move:
        """decide over the splits this run accepts (placement.check's, whose trainers can also
        split the minibatches), or --rebalance-force's."""
        args, layout = self.args, self.plan.layout
        fits = [c for c in splits(layout.world, args.prompts_per_step, args.placement.max_staleness,
                                  layout.mode)
                if args.prompts_per_step // c.dp * args.num_generations % args.minibatches == 0]
        force = dict(zip(self.cfg.rebalance_force[::2], self.cfg.rebalance_force[1::2]))
        if step + 1 in force:
            to = next(c for c in fits if side(c) == force[step + 1])
            return Move(to, f"{side(layout)} -> {side(to)} {ranks(to)}: forced (--rebalance-force)",
                        self.window[-1]["step_s"], self.window[-1]["step_s"])
        horizon = min(self.cfg.rebalance_gap, args.steps - step - 1)
        cfg = self.cfg
        return decide(self.window[-cfg.rebalance_window:], layout, fits, args.placement.max_staleness,
                      self.cost_s, horizon, cfg.rebalance_threshold, self.since_move, cfg.rebalance_gap)

    def _move(self, step: int, move: Move, saved) -> bool:
        """The move after `step`: a checkpoint, then rank 0 writes the new layout and logs why.
        False (no move) when the checkpoint failed: the run goes on as it was."""
        run_dir, at = self.args.run_args.run_dir, time.time()
        record = {"step": step + 1, "at": at, "mode": self.plan.mode, "from": side(self.plan.layout),
                  "to": side(move.layout), "why": move.why, "step_s": move.step_s,
                  "predicted_s": move.predicted_s, "gain_s": move.gain_s, "cost_s": self.cost_s,
                  "digest": checkpoint.digest(self.actor)}
        self.timings["digest_s"] = time.time() - at
        done = checkpoint.save(run_dir, step + 1, self.actor, self.args.run_args.keep_last, self.plan.rank,
                               extra=saved[0], rank_state=saved[1])
        if done["path"] is None:
            if self.plan.rank == 0:
                print(f"rebalance after step {step + 1}: {move.why}; not moving: the checkpoint failed "
                      f"({done['error']})", flush=True)
            return False
        if self.plan.rank == 0:
            record_move(run_dir, record)
            self.log.log(step, {"event": "placement/rebalance", "placement/rebalance_why": move.why,
                                "placement/rebalance_from": record["from"],
                                "placement/rebalance_to": record["to"],
                                "placement/rebalance_step_s": move.step_s,
                                "placement/rebalance_predicted_s": move.predicted_s,
                                "placement/rebalance_gain_s": move.gain_s,
                                "placement/rebalance_cost_s": self.cost_s})
        # the new layout is on disk before any rank leaves
        torch.distributed.barrier(group=self.plan.trainer_group)
        return True
