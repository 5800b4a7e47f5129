"""Mistakes a user can fix end the run with one line, not a traceback.

`UserError` is raised where a flag, a file or a user's function is wrong, with a message that
names it and says what to change. `install` makes such an error end the process with

    error: <the message>

printed once (by rank 0 of a torchrun job; the other ranks, which meet the same mistake, exit
quietly) and exit code 2; a mistake that only another rank met is said by that rank. A rank
whose peer went away (a collective that broke off: `lost_peer`) says so in one line too, exit
code 1. Any other exception is a bug and keeps its traceback. RL_DEBUG=1 brings tracebacks back for user
errors too. A rank that met a mistake marks it in the job's store first: a peer that then breaks
off in a collective with it (or fails on what it left undone) stays quiet, so the mistake's line is
the only one.
"""
import dataclasses
import os
import re
import signal
import sys
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout

WAIT_S = 10  # see _report
MARK = "rl/user_error"  # in the job's store: a rank met a mistake and says it
SAID = "rl/user_error_said"  # in the job's store: rank 0 says a mistake (the others stay quiet)


class UserError(ValueError):
    """A mistake in a flag, a file or a user's function; the message says what to change."""


def check_rules(cfg, rules):
    """rules: [(flag, holds, says)] over the fields of `cfg` (a flags dataclass); the first that
    does not hold is the error "--flag VALUE: <says>". `says` is the rest of a sentence: what is
    wrong and what to do, "use 1 or more" for a range, "it only applies to ...: add ..." for a
    combination (tests/test_errors.py reads every table and refuses a rule that says no remedy)."""
    for name, holds, says in rules:
        if not holds:
            raise UserError(f"{flag(name)} {getattr(cfg, name)}: {says}")


def flag(name: str) -> str:
    """A field's command-line spelling: mismatch_level -> --mismatch-level."""
    return "--" + name.replace("_", "-")


def flags_of(args) -> dict:
    """{field: the flags dataclass holding it} over `args` and the components' flags nested in it
    (flags.Flat: their names are flat, so unique)."""
    owners = {}
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if dataclasses.is_dataclass(value):
            owners.update(flags_of(value))
        else:
            owners[f.name] = args
    return owners


def default_of(owner, name: str):
    f = {f.name: f for f in dataclasses.fields(owner)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def check_applies(args):
    """A flag that only applies under another flag, moved from its default while that one is off,
    is refused rather than ignored (`--mismatch-level sequence` without `--mismatch` used to run
    to the end with no correction). Each flags dataclass lists such flags in its APPLIES:
    {flag: (the flag it needs, when that flag's value makes it apply, what to add)}."""
    owners = flags_of(args)
    for owner in {id(o): o for o in owners.values()}.values():
        for name, (needs, applies, add) in getattr(owner, "APPLIES", {}).items():
            value = getattr(owner, name)
            if value != default_of(owner, name) and not applies(getattr(owners[needs], needs)):
                raise UserError(f"{flag(name)} {value}: it only applies to {add} (add that, or drop "
                                f"{flag(name)})")


def install():
    """Route uncaught exceptions through `_report`."""
    sys.excepthook = _report


def cli(flags_class):
    """tyro's parse of the command line. Only rank 0 speaks: a typo in a flag is reported once,
    not once per rank, followed by an `error:` line."""
    import tyro

    rank = os.environ.get("RANK", "0")
    try:
        if rank == "0":
            return tyro.cli(flags_class)
        with open(os.devnull, "w") as quiet, redirect_stdout(quiet), redirect_stderr(quiet):
            return tyro.cli(flags_class)
    except SystemExit as e:
        if e.code and rank == "0":  # not --help
            print(f"error: the flags do not parse (see above); python {sys.argv[0]} --help lists them",
                  file=sys.stderr, flush=True)
        elif e.code:
            wait_for_rank_0()
        raise


def wait_for_rank_0() -> bool:
    """On a rank other than 0 that met a mistake: the ranks meet the same mistake together, and
    rank 0 says it; torchrun then stops this rank during the wait. Were this rank to leave
    first, torchrun could stop rank 0 before it said anything. True once rank 0 marked in the
    job's store that it says a mistake: torchrun's SIGTERM can come before this wait began (a
    loaded machine), while a handler of the run's own was still installed and took it, so the
    store, not the signal, ends the wait."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        try:
            if _store().check([SAID]):
                return True
        except Exception:
            pass
        time.sleep(0.1)
    return False


def lost_peer(error: BaseException) -> bool:
    """A collective or store call that failed because the other side went away, not a bug here:
    gloo's own transport errors (connection reset or closed, timeouts; ours, which quote them,
    keep their words) and torch's DistError family."""
    import torch.distributed as dist

    gloo = isinstance(error, RuntimeError) and re.match(r"\[[^\]]*gloo/transport", str(error))
    return isinstance(error, dist.DistError) or bool(gloo)


def _store():
    """The process group's store (torchrun's), or None before the group or after it broke."""
    try:
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:
        return None


def _mark_mistake(rank: int):
    try:
        _store().set(MARK, str(rank))
    except Exception:  # no group yet (the peers meet the same check), or it is gone
        pass


def _peer_met_mistake() -> bool:
    try:
        return _store().check([MARK])
    except Exception:
        return False


def newest_checkpoint() -> str:
    """Where a lost peer leaves the run, said in its message. flags.parse replaces this with
    utils.checkpoint.newest_said for the run's --run-dir, which names the checkpoint (errors sits
    below checkpoint, so it cannot look for itself); callers reach it as errors.newest_checkpoint()."""
    return "The newest complete checkpoint in --run-dir is intact: --resume auto goes on from it."


def _report(kind, error, tb):
    # to the real stderr: torch.distributed wraps this hook with one that buffers sys.stderr
    # (to prefix each line with the rank) and would lose what is written before os._exit
    stderr = sys.__stderr__
    rank = int(os.environ.get("RANK", "0"))
    if issubclass(kind, KeyboardInterrupt):  # Ctrl-C before the step loop (which saves and stops)
        if rank == 0:
            print("interrupted", file=stderr, flush=True)
        os._exit(130)
    if issubclass(kind, UserError):
        _mark_mistake(rank)
    elif os.environ.get("RL_DEBUG") != "1" and _peer_met_mistake():
        os._exit(1)  # another rank met a mistake and says it; this one only lost its peer
    if lost_peer(error) and os.environ.get("RL_DEBUG") != "1":
        print(f"error: (rank {rank}) another rank stopped answering in a collective: it died, its node went "
              f"away, or it hung longer than --timeout-s (see its output, or its node's). "
              f"{newest_checkpoint()} ({str(error)[:160]})",
              file=stderr, flush=True)
        os._exit(1)
    if not issubclass(kind, UserError) or os.environ.get("RL_DEBUG") == "1":
        for line in "".join(traceback.format_exception(kind, error, tb)).splitlines():
            print(f"[rank{rank}]: {line}", file=stderr)
        stderr.flush()
        os._exit(1)  # not a normal exit: with gloo running it can abort (see utils.dist.exit_now)
    if rank != 0:
        if not wait_for_rank_0():  # a mistake only this rank met, said by it
            print(f"error: (rank {rank}) {error}", file=stderr, flush=True)
    else:
        try:
            _store().set(SAID, "1")
        except Exception:
            pass
        print(f"error: {error}", file=stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)
