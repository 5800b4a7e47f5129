"""The suite's torchrun: each launch's ranks forked from a warm process, not started afresh.

`torchrun --standalone --nproc-per-node=N script.py ...` starts N + 1 interpreters: the agent
imports torch, each rank torch and our modules (3.3 s and 5.1 s on this machine under a suite's
load; vLLM 5 s more). Here a server per pytest worker imports them once (started by the first
launch, gone with the worker; a second has vLLM imported, for launches naming it). Per launch it
forks a job process, which forks the N ranks and, as torchrun's agent does, hosts their store (a
TCPStore on a port the OS picks as it binds; TORCHELASTIC_USE_AGENT_STORE tells utils.dist.init to
join it) and gives each rank torchrun's environment; a rank runs the script as `__main__`. Their
stdout and stderr each go to one file, as torchrun's children share its two pipes. A rank that
fails brings the others down (SIGTERM, SIGKILL 10 s later), as torchrun's agent does.

What a forked rank does not get: anything read at interpreter start-up (PYTHON* variables; of
malloc's environment it gets MALLOC_MMAP_THRESHOLD_, through mallopt) and torchrun's own
behaviour (restarts, several nodes, a worker found by its command line). Tests of those start
`python -m torch.distributed.run` themselves, or pass `fresh=True` to torchrun(). RL_TEST_FORK=0
runs every launch under torchrun itself."""
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = ["torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "safetensors.torch", "tyro",
        "transformers", "train_grpo", "train_ppo", "train_rm", "train_flow_grpo"]  # what the scripts import


def torchrun(nproc, *args, timeout=240, fresh=False, check=True, env=None):
    """Runs a script (its path, then its arguments) on nproc ranks as torchrun --standalone would;
    a hung rank fails the test at `timeout`, not CI. fresh: under torchrun itself; check: assert
    that it succeeded (False: a test of a failure reads the returned process); env: variables to
    add."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    if fresh or os.environ.get("RL_TEST_FORK") == "0":
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            code = Forked(nproc, list(args), env, out, err, timeout).wait()
            read = [open(f, errors="replace").read() if os.path.exists(f) else "" for f in (out, err)]
            p = subprocess.CompletedProcess(cmd, code, *read)
    assert p.returncode == 0 or not check, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def start(cmd, log, timeout=240, fresh=False):
    """A launch that the test does not wait for (it kills or signals a rank): `cmd` a torchrun
    command line, its output to the open file `log`. Returns what has subprocess.Popen's poll,
    wait and kill, and `ranks()`, {local rank: pid}: a Popen of torchrun itself where the line
    asks for more than --standalone --nproc-per-node (restarts, say) or `fresh`, else forked ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nproc = cmd[4].removeprefix("--nproc-per-node=") if len(cmd) > 5 else ""
    if cmd[2:4] != ["torch.distributed.run", "--standalone"] or not nproc.isdigit() or \
            cmd[5].startswith("-") or fresh or os.environ.get("RL_TEST_FORK") == "0":
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        p.ranks = lambda: torchrun_workers(p.pid)
        return p
    return Forked(int(nproc), cmd[5:], env, log.name, log.name, timeout)


def helper(args, out, err, timeout=300):
    """A script of tests/helpers (its path, then its arguments), as `python SCRIPT ...` would run
    it, its stdout and stderr to the open named files `out` and `err`: one forked rank (a world of
    one, torchrun's environment; a vllm_* script from the server with vLLM imported, which saves
    each its 5-10 s of imports), or with RL_TEST_FORK=0 a fresh interpreter. Returns what has
    Popen's wait, kill and returncode (a killed job: its process group, vLLM's processes too)."""
    if os.environ.get("RL_TEST_FORK") == "0":
        p = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=err,
                             start_new_session=True)
        p.kill = lambda: _killpg(p.pid)
        return p
    return Forked(1, list(args), dict(os.environ), out.name, err.name, timeout)


def _killpg(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # it ended already
        pass


def torchrun_workers(pid):
    """The torchrun agent `pid`'s worker processes: {local rank: pid}."""
    out = {}
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        for child in map(int, f.read().split()):
            env = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
            rank = [e for e in env if e.startswith(b"LOCAL_RANK=")]
            if rank:
                out[int(rank[0].split(b"=")[1])] = child
    return out


_server = {}


class Forked:
    """One launch on the server's forked ranks, their stdout and stderr appended to the files `out`
    and `err`. The server replies three lines as the launch goes: the job's pid (it leads its own
    process group), its ranks' pids, the exit code."""

    def __init__(self, nproc, args, env, out, err, timeout):
        # `--engine vllm` or a vllm_* helper: from a second server, which has vLLM imported
        kind = "vllm" if any(a == "vllm" or os.path.basename(a).startswith("vllm") for a in args) else "plain"
        if kind not in _server or _server[kind]["proc"].poll() is not None:
            path = os.path.join(tempfile.mkdtemp(prefix="rl-launch-"), "socket")
            # the server reads its stdin to know when its worker is gone: at EOF it ends
            proc = subprocess.Popen([sys.executable, "-m", "tests.launch", path, kind], cwd=ROOT,
                                    stdin=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
            _server[kind] = dict(path=path, proc=proc)
        server = _server[kind]
        self.args, self.timeout, self.deadline = args, timeout, time.monotonic() + timeout
        self.conn, self.reply, self.returncode = socket.socket(socket.AF_UNIX), b"", None
        while True:  # the server binds its socket once its imports are done
            try:
                self.conn.connect(server["path"])
                break
            except (FileNotFoundError, ConnectionRefusedError):
                assert server["proc"].poll() is None, "the launch server died while starting"
                self._check_deadline()
                time.sleep(0.1)
        self.conn.sendall(pickle.dumps(dict(nproc=nproc, args=args, env=env, out=out, err=err)))
        self.conn.shutdown(socket.SHUT_WR)

    def _lines(self, n, block=True):
        """The reply's first n lines, reading until they are there (block) or what came so far."""
        while self.reply.count(b"\n") < n:
            self.conn.settimeout(max(0.01, self.deadline - time.monotonic()) if block else 0)
            try:
                chunk = self.conn.recv(1 << 16)
            except BlockingIOError:
                break
            except socket.timeout:
                self._check_deadline()
                continue
            if not chunk:
                raise RuntimeError(f"the launch server's job ended without a reply: {self.reply!r}")
            self.reply += chunk
        return self.reply.split(b"\n")[:n]

    def _check_deadline(self):
        if time.monotonic() > self.deadline:
            self.kill()  # the job leads its own process group, all its ranks
            self.conn.close()
            raise subprocess.TimeoutExpired(self.args, self.timeout)

    def kill(self):
        if b"\n" in self.reply and self.reply.count(b"\n") < 3:  # its pid came, its exit code not yet
            _killpg(int(self.reply.split(b"\n")[0]))

    def ranks(self):
        return dict(enumerate(map(int, self._lines(2)[1].split())))

    def poll(self):
        if self.returncode is None:
            self._lines(3, block=False)  # what has come so far
            if self.reply.count(b"\n") >= 3:
                self.wait()  # the exit code is there: no waiting
        return self.returncode

    def wait(self, timeout=None):
        if timeout is not None:  # as Popen.wait: from now
            self.deadline = time.monotonic() + timeout
        if self.returncode is None:
            self.returncode = int(self._lines(3)[2])
            self.conn.close()
        return self.returncode


def serve(path, kind):
    """The server: warm imports, then one forked job per connection, until stdin closes."""
    import importlib

    for name in WARM + (["vllm", "engines.vllm_transfer", "vllm.lora.request"] if kind == "vllm" else []):
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the jobs
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".new")
    listener.listen(8)
    os.rename(path + ".new", path)  # connectable only now
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1 << 10):
            os._exit(0)
        if listener in ready:
            conn, _ = listener.accept()
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                listener.close()
                try:
                    _job(conn)
                finally:  # never back into this loop (a test gone before its reply: a broken pipe),
                    if os.getpgid(0) == os.getpid():  # and no rank left behind
                        os.killpg(0, signal.SIGKILL)
                    os._exit(1)
            conn.close()


def _job(conn):
    """One launch: fork the ranks, host their store, wait; reply `pid\\nrank pids\\nexit code\\n`."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    conn.sendall(f"{os.getpid()}\n".encode())
    data = b""
    while chunk := conn.recv(1 << 16):
        data += chunk
    job = pickle.loads(data)
    ranks, pipes = {}, []
    for rank in range(job["nproc"]):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            conn.close()
            os.close(w)
            port = int(os.read(r, 64))
            _rank(job, rank, port)
        os.close(r)
        ranks[pid], pipes = rank, pipes + [w]
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, job["nproc"], is_master=True, wait_for_workers=False)
    for w in pipes:
        os.write(w, str(store.port).encode())
        os.close(w)
    conn.sendall((" ".join(str(pid) for pid in ranks) + "\n").encode())  # in rank order
    code, left = 0, set(ranks)
    while left:
        pid, status = os.waitpid(-1, 0)
        left.discard(pid)
        status = os.waitstatus_to_exitcode(status)
        if status and not code:  # the first failure ends the launch, as under torchrun
            code = 1
            for other in left:
                os.kill(other, signal.SIGTERM)
            signal.signal(signal.SIGALRM, lambda *_: [_kill(p) for p in left])
            signal.alarm(10)
    conn.sendall(f"{code}\n".encode())
    os._exit(0)


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _rank(job, rank, port):
    """Runs the script in this process as torchrun's worker `rank` would, then ends it."""
    import atexit
    import runpy

    nproc, args = job["nproc"], job["args"]
    code = 0
    try:
        for fd, name in ((1, "out"), (2, "err")):
            f = os.open(job[name], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(f, fd)
            os.close(f)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.environ.clear()
        os.environ.update(job["env"], RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                          ROLE_RANK=str(rank), ROLE_NAME="default", WORLD_SIZE=str(nproc),
                          LOCAL_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
                          TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
                          TORCHELASTIC_USE_AGENT_STORE="True")
        if "MALLOC_MMAP_THRESHOLD_" in job["env"]:  # glibc reads it at start-up: set it as it would
            import ctypes

            M_MMAP_THRESHOLD = -3
            ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, int(job["env"]["MALLOC_MMAP_THRESHOLD_"]))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = ROOT
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.join(ROOT, args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter reports an uncaught exception (the
        code = 1  # scripts install a hook that turns a user's mistake into one line)
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    serve(*sys.argv[1:])
