"""Mistakes a user can fix end the run with one line, not a traceback.

`UserError` is raised where a flag, a file or a user's function is wrong, with a message that
names it and says what to change. `install` makes such an error end the process with

    error: <the message>

printed once (by rank 0 of a torchrun job; the other ranks, which meet the same mistake, exit
quietly) and exit code 2; a mistake that only another rank met is said by that rank. A rank
whose peer went away (a collective that broke off: `lost_peer`) says so in one line too, exit
code 1. Any other exception is a bug and keeps its traceback. RL_DEBUG=1 brings tracebacks back for user
errors too.
"""
import os
import re
import signal
from contextlib import redirect_stderr, redirect_stdout
import sys
import time
import traceback

WAIT_S = 10  # see _report


class UserError(ValueError):
    """A mistake in a flag, a file or a user's function; the message says what to change."""


def check_rules(cfg, rules):
    """rules: [(flag, holds, what to use instead)] over the fields of `cfg` (a flags dataclass);
    the first that does not hold is the error, naming the flag and its value."""
    for flag, holds, use in rules:
        if not holds:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(cfg, flag)}: use {use}")


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


def wait_for_rank_0():
    """On a rank other than 0 that met a mistake: the ranks meet the same mistake together, and
    rank 0 says it; torchrun then stops this rank during the wait. Were this rank to leave
    first, torchrun could stop rank 0 before it said anything."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(WAIT_S)


def lost_peer(error: BaseException) -> bool:
    """A collective or store call that failed because the other side went away, not a bug here:
    gloo's own transport errors (connection reset or closed, timeouts; ours, which quote them,
    keep their words) and torch's DistError family."""
    import torch.distributed as dist

    gloo = isinstance(error, RuntimeError) and re.match(r"\[[^\]]*gloo/transport", str(error))
    return isinstance(error, dist.DistError) or bool(gloo)


def _report(kind, error, tb):
    # to the real stderr: torch.distributed wraps this hook with one that buffers sys.stderr
    # (to prefix each line with the rank) and would lose what is written before os._exit
    stderr = sys.__stderr__
    rank = int(os.environ.get("RANK", "0"))
    if issubclass(kind, KeyboardInterrupt):  # Ctrl-C before the step loop (which saves and stops)
        if rank == 0:
            print("interrupted", file=stderr, flush=True)
        os._exit(130)
    if lost_peer(error) and os.environ.get("RL_DEBUG") != "1":
        print(f"error: (rank {rank}) another rank stopped answering in a collective: it died, its node went "
              f"away, or it hung longer than --timeout-s (see its output, or its node's). The newest "
              f"complete checkpoint in --run-dir is intact: --resume auto goes on from it. "
              f"({str(error)[:160]})",
              file=stderr, flush=True)
        os._exit(1)
    if not issubclass(kind, UserError) or os.environ.get("RL_DEBUG") == "1":
        for line in "".join(traceback.format_exception(kind, error, tb)).splitlines():
            print(f"[rank{rank}]: {line}", file=stderr)
        stderr.flush()
        os._exit(1)  # not a normal exit: with gloo running it can abort (see utils.dist.exit_now)
    if rank != 0:
        wait_for_rank_0()
        # still here: a mistake only this rank met, said by it
        print(f"error: (rank {rank}) {error}", file=stderr, flush=True)
    else:
        print(f"error: {error}", file=stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)
