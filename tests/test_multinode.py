"""Many nodes on one machine: two torchrun launchers joined by torchrun's c10d rendezvous, as
two nodes of a cluster would be (docs/scale.md: Many nodes). The rendezvous store is hosted here,
bound to port 0 by the kernel (no port is picked ahead of binding), and both launchers join
it as clients (`is_host=false`); torchrun's node 0 then hosts the workers' own store."""
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch.distributed as dist
from test_disaggregate import DISAGG, metrics
from test_fsdp import ROOT, torchrun
from test_train_grpo import TINY

from tests.helpers.runs import differences_within


def nodes(nprocs: list[int], args: list[str], logs: list[str]):
    """One torchrun launcher per node (`nprocs[i]` ranks on node i): (the rendezvous store, the
    launchers). The store must outlive the launchers."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "test",
            "--rdzv-conf", "is_host=false", "--local-addr", "127.0.0.1"]
    launchers = []
    for n, log in zip(nprocs, logs):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(nprocs)}",
               f"--nproc-per-node={n}", *rdzv, "train_grpo.py", *args]
        launchers.append(subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}))
    return store, launchers


def run_nodes(nprocs, args, tmp_path, timeout=240):
    logs = [str(tmp_path / f"node{i}.log") for i in range(len(nprocs))]
    store, launchers = nodes(nprocs, args, logs)
    try:
        codes = [p.wait(timeout=timeout) for p in launchers]
    finally:
        for p in launchers:
            p.kill()
    assert codes == [0] * len(nprocs), "\n".join(open(log).read()[-3000:] for log in logs)


@pytest.mark.reordered
def test_two_nodes_train_alike_in_colocate_and_disaggregate(tmp_path):
    """A full GRPO run across two nodes: colocate with a trainer on each node (FSDP's collectives
    cross nodes), then disaggregate with the trainers on one node and the rollout rank on the
    other (the weight sync crosses nodes). At --max-staleness 0 the two are the same
    experiment (tests/test_disaggregate.py), so every non-timing metric agrees to rounding. Not
    to the bit: the trainers of the two launches get os.cpu_count() // 1 and // 2 threads
    (utils/dist.py), and a kernel may sum in another order on another thread count (on an
    AVX-512 machine the log-prob gap, itself rounding noise, came out 1e-6 and 2e-6)."""
    co, dis = str(tmp_path / "co"), str(tmp_path / "dis")
    run_nodes([1, 1], [*TINY, "--run-dir", co], tmp_path)
    run_nodes([2, 1], [*TINY, *DISAGG, "--max-staleness", "0", "--run-dir", dis], tmp_path)
    a, b = metrics(co), metrics(dis)
    assert len(a) == 4 and differences_within(a, b) == []
    assert all(r["perf/sync_bytes"] > 0 for r in b[:3])


def test_a_dead_node_fails_the_other_clearly_and_soon(tmp_path):
    """Node 1 (its launcher and its rank) is killed after a checkpoint: node 0's rank says in one
    line that another rank stopped answering, well within --timeout-s, and the newest complete
    checkpoint resumes."""
    run, log = str(tmp_path / "run"), str(tmp_path / "node0.log")
    timeout_s = 60
    args = [*TINY, "--steps", "400", "--save-every", "2", "--timeout-s", str(timeout_s), "--run-dir", run]
    store, (node0, node1) = nodes([1, 1], args, [log, str(tmp_path / "node1.log")])
    try:
        deadline = time.monotonic() + 120
        while "step    5/" not in open(log).read():  # step 4's checkpoint is complete
            assert time.monotonic() < deadline and node0.poll() is None, open(log).read()[-3000:]
            time.sleep(0.05)
        launcher = psutil.Process(node1.pid)
        for p in [launcher, *launcher.children(recursive=True)]:  # the whole node goes
            p.kill()
        t = time.monotonic()
        code = node0.wait(timeout=timeout_s + 60)
        seconds = time.monotonic() - t
    finally:
        node0.kill()
        node1.kill()
    out = open(log).read()
    assert code != 0 and seconds < timeout_s, (code, seconds)
    assert "error: (rank 0) another rank stopped answering in a collective: it died, its node went" in out
    assert f"The newest complete checkpoint, {run}/checkpoints/step_" in out  # named, as it is
    assert "[rank0]: Traceback" not in out, out[-3000:]  # our line, not a trace
    p = torchrun(2, "train_grpo.py", *TINY, "--steps", "8", "--resume", "auto", "--run-dir", run)
    assert "resumed from" in p.stdout and os.path.isdir(os.path.join(run, "final")), p.stdout[-2000:]
