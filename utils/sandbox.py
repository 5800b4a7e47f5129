"""The code reward's sandbox: a separate process with a time limit, a memory limit, no network
and its own PID namespace (roles/reward.py `code_passes` runs each completion's code in it); and
`time_limit`, which interrupts a reward function or the judge in this process."""
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager

from utils.errors import UserError


class TimeLimit(BaseException):
    """Raised by `time_limit`. Not an Exception: nothing on the way (a user function's or an
    engine's `except Exception`) swallows it."""


def _alarm(*_):
    raise TimeLimit()


@contextmanager
def time_limit(seconds: float):
    """Interrupts the Python code inside with TimeLimit after `seconds` (0: no limit): a Python
    function cannot be killed, but it can be interrupted. SIGALRM reaches only the main thread, so
    elsewhere there is no limit. Catch TimeLimit around the `with`: it may fire as it leaves."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:  # an alarm may fire on any line from here on: the handler is restored whatever it interrupts
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)


def _limits(memory_mb: int, cpu_s: int):
    """Runs in the child between fork and exec: its own session, memory and CPU caps."""
    def apply():
        os.setsid()
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_sandboxed(code: str, timeout_s: float = 5.0, memory_mb: int = 512) -> bool:
    """True if `code` runs to a clean exit inside the limits. util-linux's unshare(1) gives it
    a network namespace with nothing in it and a PID namespace of its own (it is PID 1 there
    and cannot see, signal or ptrace the trainer); rlimits cap memory and CPU; a wall-clock
    limit kills it. Whatever the code does, this process only sees a failed or killed child."""
    sandbox = ["unshare", "--net", "--pid", "--fork", "--kill-child"]
    if os.getuid() != 0:  # unprivileged: a user namespace grants the right to make the others
        sandbox[1:1] = ["--user", "--map-root-user"]
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "main.py"), "w") as f:
            f.write(code)
        p = subprocess.Popen([*sandbox, sys.executable, "-I", "main.py"], cwd=tmp, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={"PATH": "/usr/bin:/bin"}, preexec_fn=_limits(memory_mb, int(timeout_s) + 1))
        try:
            return p.wait(timeout=timeout_s) == 0
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the child's whole session: its own children too
            p.wait()
            return False


def check_sandbox():
    """Fails early, with the reason, where the sandbox cannot be built (no unshare(1), or no
    user namespaces for an unprivileged user)."""
    if not run_sandboxed("pass", timeout_s=30):
        raise UserError("the code reward's sandbox does not start here: it needs util-linux's `unshare` "
                        "and root or unprivileged user namespaces "
                        "(sysctl kernel.unprivileged_userns_clone=1)")
