"""Dynamic placement (--rebalance): move ranks between training and generation as the run goes.

`decide` is the pure decision, from the reduced busy seconds of the last steps (the same numbers
on every trainer, so every rank decides alike with no message). `Rebalancer` is the component
the step loop calls once a step (`after_step`); with --rebalance off it does nothing. A move is
a checkpoint, the new layout written to run_dir/placement.json, and every rank exiting with
MOVE_EXIT: torchrun (--max-restarts) restarts the workers, which read the layout back
(`moved_layout`), resume from the move's checkpoint and check that a digest of the full weights,
Adam's moments and the LR is the one the move left with. The move is a restart, not an
in-process re-mesh.
"""
import json
import os
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

import placement
from placement import Layout
from utils import checkpoint, dist
from utils.errors import UserError, check_rules

MOVES = "placement.json"  # in run_dir: the layout --rebalance moved to, and each move's numbers
MOVE_EXIT = 3  # a rank's exit code after a move: torchrun (--max-restarts) starts the new layout
MAX = torch.distributed.ReduceOp.MAX


@dataclass
class RebalanceArgs:
    rebalance: bool = False
    """disaggregate: move ranks between training and generation as the run goes, when the measured
    busy seconds predict a faster split that pays for the move (rebalance.decide); a move saves a
    checkpoint and torchrun restarts the workers in the new layout: launch with --max-restarts (one
    per move, plus those for failures)"""
    rebalance_threshold: float = 0.1
    """--rebalance: move only to a split predicted faster by this share of a step"""
    rebalance_window: int = 10
    """--rebalance: the steps whose mean busy seconds a decision reads"""
    rebalance_gap: int = 20
    """--rebalance: steps at least between two moves (and from the start); the horizon a move must
    pay for itself in"""
    rebalance_force: tuple[int, int] | None = None
    """--rebalance, a test hook: STEP K moves to K rollout ranks after STEP steps, whatever the
    measurements say"""
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        "rebalance_threshold": ("rebalance", bool, "--rebalance"),
        "rebalance_window": ("rebalance", bool, "--rebalance"),
        "rebalance_gap": ("rebalance", bool, "--rebalance")}

    def check(self, args, world: int, layout: Layout):
        check_rules(self, [
            ("rebalance", not self.rebalance or args.layout.placement == "disaggregate",
             "it moves ranks between trainers and rollout ranks: add --placement disaggregate "
             "--rollout-ranks K"),
            ("rebalance", not self.rebalance or not args.ds.dynamic_sampling,
             "dynamic sampling keeps a prompt stream per trainer, which a move would split differently; "
             "drop one"),
            ("rebalance", not self.rebalance or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) >= 1,
             "a move restarts the workers in the new layout: launch with torchrun --max-restarts N (one per "
             "move you allow, plus those for failures)"),
            ("rebalance_threshold", 0 <= self.rebalance_threshold < 1,
             "a share of a step in [0, 1), such as 0.1"),
            ("rebalance_window", self.rebalance_window >= 1, "1 or more steps"),
            ("rebalance_gap", self.rebalance_gap >= self.rebalance_window,
             f"at least --rebalance-window ({self.rebalance_window}): a decision reads only steps since the "
             f"last move"),
            ("rebalance_force", self.rebalance_force is None or self.rebalance,
             "it forces a --rebalance move: add --rebalance")])
        if self.rebalance_force:
            fits = [c.rollout for c in splits(world, args.prompts_per_step, args.layout.max_staleness)
                    if c.rollout != layout.rollout]
            step, k = self.rebalance_force
            if k not in fits:
                raise UserError(f"--rebalance-force {step} {k}: a world of {world} can move from "
                                f"{layout.rollout} rollout ranks to {fits or 'none other'}")


@dataclass
class Move:
    """A rebalancing decision: the layout to move to (None: stay) and the numbers behind it."""
    layout: Layout | None
    why: str
    step_s: float = 0.0  # the window's mean step time now
    predicted_s: float = 0.0  # the best other layout's predicted step time
    gain_s: float = 0.0  # predicted seconds saved over the horizon, less the move's cost


def splits(world: int, prompts_per_step: int, max_staleness: int) -> list[Layout]:
    """Every disaggregated layout of `world` ranks that `placement.check` accepts for this batch."""
    fits = []
    for k in range(1, world):
        try:
            fits.append(placement.check("disaggregate", world, prompts_per_step, k, max_staleness))
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
    steps ago), so that a move's own disturbance cannot trigger the next one.
    window: [{"trainer_busy", "rollout_busy", "step_s"}] per step."""
    if layout.mode != "disaggregate":
        return Move(None, f"{layout.mode} placement has no rollout ranks to move")
    if since_move < min_gap:
        return Move(None, f"{since_move} steps since the last move, under the minimum gap of {min_gap}")
    n = len(window)
    step_s = sum(w["step_s"] for w in window) / n
    train = sum(w["trainer_busy"] for w in window) / n * layout.dp  # trainer-seconds per step
    generate = sum(w["rollout_busy"] for w in window) / n * layout.rollout  # rollout-rank-seconds per step

    def predicted(k: int) -> float:
        sides = (train / (layout.world - k), generate / k)
        return max(sides) if max_staleness else sum(sides)

    others = [c for c in fits if c.rollout != layout.rollout]
    best = min(others, key=lambda c: predicted(c.rollout), default=None)
    if best is None:
        return Move(None, "no other split fits the world and the batch", step_s)
    faster = step_s - predicted(best.rollout)
    gain = faster * horizon - move_cost_s
    move = Move(None, "", step_s, predicted(best.rollout), gain)
    if faster < threshold * step_s:
        move.why = (f"{best.rollout} rollout ranks would save {faster / step_s:.0%} of a step, under the "
                    f"threshold {threshold:.0%}")
    elif gain <= 0:
        move.why = (f"the move costs {move_cost_s:.0f}s, more than the {faster * horizon:.0f}s it saves over "
                    f"{horizon} steps")
    else:
        move.layout, move.why = best, (f"{layout.rollout} -> {best.rollout} rollout ranks: {step_s:.2f}s -> "
                                       f"{predicted(best.rollout):.2f}s per step predicted")
    return move


def moves(run_dir: str) -> dict:
    """{"rollout_ranks": K, "moves": [...]} as the last move left it ({} before any)."""
    path = os.path.join(run_dir, MOVES)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def record_move(run_dir: str, record: dict):
    """Rank 0, after the move's checkpoint is complete: the new layout, written whole (a rename)."""
    state = moves(run_dir)
    state = {"rollout_ranks": record["to"], "moves": [*state.get("moves", []), record]}
    tmp = os.path.join(run_dir, MOVES + ".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, os.path.join(run_dir, MOVES))


def moved_layout(args) -> dict:
    """Before the process group: a launch that torchrun restarted after a move (or --resume auto)
    takes the layout the move wrote (args.layout.rollout_ranks). Returns the moves so far."""
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    moved = {}
    if args.balance.rebalance and (restarted or args.run.resume == "auto"):
        moved = moves(args.run.run_dir)
    if moved:
        args.layout.rollout_ranks = moved["rollout_ranks"]
    return moved


class Rebalancer:
    """--rebalance in the step loop: `after_step` keeps the window of reduced busy seconds, asks
    `decide` and makes the move. Off, it does nothing. `exit_code` is MOVE_EXIT after a move."""

    def __init__(self, args, plan, actor, moved: dict, start: int, launched: float, log, saved=None):
        """saved(): what the move's checkpoint carries of the other components (the rollout's state)."""
        self.args, self.cfg, self.plan, self.actor, self.log = args, args.balance, plan, actor, log
        self.saved = saved or (lambda: ({}, {}))
        self.window, self.since_move, self.warned, self.exit_code = [], 0, False, 0
        self.cost_s = 0.0
        if self.cfg.rebalance:
            self.cost_s = self._arrived(moved, start, launched)

    def _arrived(self, moved: dict, start: int, launched: float) -> float:
        """Before the first step: the seconds a move costs (the last move's, measured from its
        decision to here; before any, this launch's start-up), the same on every trainer. Right
        after a move, the training state must be the one it left with, exactly (a digest of it)."""
        last = moved["moves"][-1] if moved else None
        since = last["at"] if last else launched
        cost_s = dist.reduce({"s": time.time() - since}, op=MAX, group=self.plan.trainer_group)["s"]
        if last and last["step"] == start:
            if checkpoint.digest(self.actor) != last["digest"]:
                raise RuntimeError(f"the move after step {start} did not carry the training state exactly "
                                   f"(its digest differs): a bug; "
                                   f"{checkpoint.last_complete(self.args.run.run_dir)}")
            if self.plan.rank == 0:
                self.log.log(start - 1, {"event": "placement/moved", "placement/move_s": cost_s,
                                         "placement/move_state_equal": 1.0,
                                         "placement/rollout_ranks": self.plan.layout.rollout})
        return cost_s

    def after_step(self, step: int, entry: dict) -> bool:
        """After step `step` (0-based), from its reduced busy seconds `entry`: True when the ranks
        move (every rank then leaves the loop)."""
        if not self.cfg.rebalance:
            return False
        self.window.append(entry)
        self.since_move += 1
        move = self._decide(step)
        restarts_left = int(os.environ["TORCHELASTIC_MAX_RESTARTS"]) - int(
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if move.layout is not None and restarts_left < 1:
            if self.plan.rank == 0 and not self.warned:
                print(f"rebalance after step {step + 1}: {move.why}; not moving: torchrun has no restart "
                      f"left (--max-restarts used up)", flush=True)
            self.warned = True
            return False
        if move.layout is None or not self._move(step, move, self.saved()):
            return False
        if self.plan.rank == 0:
            k = move.layout.rollout
            print(f"moving: every rank stops; torchrun restarts them as {self.plan.layout.world - k} "
                  f"trainers + {k} rollout ranks, resuming at step {step + 2}", flush=True)
        self.exit_code = MOVE_EXIT
        return True

    def _decide(self, step: int) -> Move:
        """decide over the splits this run accepts (placement.check's, whose trainers can also
        split the minibatches), or --rebalance-force's."""
        args, layout = self.args, self.plan.layout
        fits = [c for c in splits(layout.world, args.prompts_per_step, args.layout.max_staleness)
                if args.prompts_per_step // c.dp * args.num_generations % args.minibatches == 0]
        force = self.cfg.rebalance_force
        if force and force[0] == step + 1:
            to = next(c for c in fits if c.rollout == force[1])
            return Move(to, f"{layout.rollout} -> {to.rollout} rollout ranks: forced (--rebalance-force)",
                        self.window[-1]["step_s"], self.window[-1]["step_s"])
        horizon = min(self.cfg.rebalance_gap, args.steps - step - 1)
        cfg = self.cfg
        return decide(self.window[-cfg.rebalance_window:], layout, fits, args.layout.max_staleness,
                      self.cost_s, horizon, cfg.rebalance_threshold, self.since_move, cfg.rebalance_gap)

    def _move(self, step: int, move: Move, saved) -> bool:
        """The move after `step`: a checkpoint, then rank 0 writes the new layout and logs why.
        False (no move) when the checkpoint failed: the run goes on as it was."""
        run_dir = self.args.run.run_dir
        record = {"step": step + 1, "at": time.time(), "from": self.plan.layout.rollout,
                  "to": move.layout.rollout, "why": move.why, "step_s": move.step_s,
                  "predicted_s": move.predicted_s, "gain_s": move.gain_s, "cost_s": self.cost_s,
                  "digest": checkpoint.digest(self.actor)}
        done = checkpoint.save(run_dir, step + 1, self.actor, self.args.run.keep_last, self.plan.rank,
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
