"""Checkpoints: atomic DCP saves, exact resume after a killed rank (torchrun elastic restart)."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from launch import start
from safetensors.torch import load_file
from test_fsdp import ROOT, torchrun
from test_train_grpo import TINY, metrics

from assets.make import random_checkpoint
from utils import checkpoint
from utils.logger import differences

FLAGS = [f for f in TINY if f not in ("--steps", "3")] + ["--steps", "10", "--save-every", "2"]


def test_partial_checkpoints_are_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_00000002").mkdir(parents=True)
    (root / "step_00000002" / "meta.json").write_text("{}")
    (root / "step_00000004.tmp").mkdir()  # killed while writing
    (root / "step_00000006").mkdir()  # no meta.json: never finished
    path, partial = checkpoint.find(str(tmp_path))
    assert path.endswith("step_00000002")
    assert [os.path.basename(p) for p in partial] == ["step_00000004.tmp", "step_00000006"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The reference: 10 steps without interruption."""
    path = str(tmp_path_factory.mktemp("straight"))
    torchrun(2, "train_grpo.py", *FLAGS, "--save-hf-every", "5", "--run-dir", path)
    return path


def same_run(a, b):
    """Bit-equal: a resume on the same ranks makes the same reductions in the same order."""
    # every step once, none lost or doubled
    assert [r["step"] for r in metrics(b)] == [r["step"] for r in metrics(a)]
    assert differences(metrics(a), metrics(b)) == []
    wa = load_file(os.path.join(a, "final", "model.safetensors"))
    wb = load_file(os.path.join(b, "final", "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def start_and_kill_rank_1(cmd, run, log_path):
    """Starts the torchrun command line `cmd` (on forked ranks where it asks for nothing more than
    --standalone --nproc-per-node: tests/launch.py start), waits for the first complete
    checkpoint, kill -9s local rank 1."""
    p = start(cmd, open(log_path, "w"))
    deadline = time.time() + 240
    while checkpoint.find(run)[0] is None:
        if p.poll() is not None or time.time() > deadline:
            p.kill()
            raise AssertionError(open(log_path).read()[-3000:])
        time.sleep(0.05)
    os.kill(p.ranks()[1], signal.SIGKILL)
    return p


def test_kill_9_a_rank_then_resume_is_exact(tmp_path, straight):
    """2N steps straight == N steps, kill -9 of one rank, `--resume auto` in a new torchrun."""
    killed = str(tmp_path / "killed")
    import transformers  # the periodic HF export loads in transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(straight, "hf", "step_10"))
    final = load_file(os.path.join(straight, "final", "model.safetensors"))
    assert torch.equal(hf.model.embed_tokens.weight.detach(), final["model.embed_tokens.weight"])

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "train_grpo.py", *FLAGS, "--run-dir", killed]
    p = start_and_kill_rank_1(cmd, killed, tmp_path / "killed.log")
    assert p.wait(timeout=120) != 0  # the job fails (the peer's collectives error out), it does not hang
    done_before = len(metrics(killed))
    assert done_before < len(metrics(straight))  # it was stopped part-way

    out = torchrun(2, "train_grpo.py", *FLAGS, "--resume", "auto", "--run-dir", killed).stdout
    assert "resumed from" in out
    same_run(straight, killed)
    kept = [k for k in sorted(os.listdir(os.path.join(killed, "checkpoints"))) if not k.endswith(".tmp")]
    assert kept == ["step_00000008", "step_00000010"]  # --keep-last 2


def test_elastic_restart_after_kill_9_resumes_by_itself(tmp_path, straight):
    """torchrun --max-restarts 1: the killed rank brings the job back; the new workers find
    the newest complete checkpoint themselves, and the run ends as if nothing happened."""
    run = str(tmp_path / "elastic")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "--max-restarts=1", "train_grpo.py", *FLAGS, "--run-dir", run]
    p = start_and_kill_rank_1(cmd, run, tmp_path / "elastic.log")
    assert p.wait(timeout=240) == 0, open(tmp_path / "elastic.log").read()[-3000:]
    assert "resumed from" in open(tmp_path / "elastic.log").read()
    same_run(straight, run)


def test_sigterm_saves_a_checkpoint_before_exit(tmp_path):
    run = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "train_grpo.py",
           *FLAGS, "--steps", "200", "--save-every", "0", "--run-dir", run]
    p = start(cmd, open(tmp_path / "run.log", "w"))
    try:
        deadline = time.time() + 240
        while not os.path.exists(os.path.join(run, "metrics.jsonl")) or len(metrics(run)) < 3:
            assert p.poll() is None and time.time() < deadline, open(tmp_path / "run.log").read()[-3000:]
            time.sleep(0.05)
        for pid in p.ranks().values():  # what a scheduler's preemption notice does
            os.kill(pid, signal.SIGTERM)
        p.wait(timeout=120)
    finally:
        p.kill()
    path, _ = checkpoint.find(run)
    assert path is not None, open(tmp_path / "run.log").read()[-3000:]
    steps_done = int(os.path.basename(path).split("_")[1])
    # saved at the step it stopped
    assert steps_done == len([r for r in metrics(run) if not r.get("final")]) >= 3

    # resuming that checkpoint with a model of another shape is a clear error, not a crash in DCP
    other = str(tmp_path / "other")
    random_checkpoint(other, num_hidden_layers=2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "train_grpo.py",
           *FLAGS, "--model", other, "--resume", "auto", "--run-dir", run]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode != 0
    assert "is from a different model shape" in p.stderr and "num_hidden_layers" in p.stderr


def test_full_disk_on_save_keeps_the_previous_checkpoint(tmp_path):
    """A 24 MiB tmpfs holds two checkpoints (11 MiB each) but not a third: that save fails,
    is reported, the previous checkpoint stays complete, and training goes on to the end."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(disk)]
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        run = str(disk / "run")
        out = torchrun(2, "train_grpo.py", *FLAGS, "--steps", "8", "--no-save-final", "--run-dir", run).stdout
        assert "checkpoint after step 6 FAILED" in out and "step_00000004) is intact; training goes on" in out
        assert [r["step"] for r in metrics(run)] == list(range(8)) + [7]
        path, partial = checkpoint.find(run)
        assert path.endswith("step_00000004") and partial == []  # the failed one was cleaned up
        out = torchrun(2, "train_grpo.py", *FLAGS, "--steps", "8", "--no-save-final", "--save-every", "0",
                       "--resume", "auto", "--run-dir", run).stdout
        assert "resumed from" in out and "step_00000004" in out  # and it is usable
    finally:
        subprocess.run(["umount", str(disk)])


def test_a_tampered_checkpoint_index_is_refused_not_executed(tmp_path):
    """DCP's .metadata is a pickle: ours is read by an unpickler that admits DCP's classes only."""
    import pickle

    from utils.checkpoint import SafeReader

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load it"):
        SafeReader(str(tmp_path)).read_metadata()
    assert not marker.exists()  # (the resume tests read real checkpoints through the same reader)


def test_a_checkpoint_from_before_fused_adamw_resumes_fused(tmp_path):
    """Optimizer flags such as `fused` say how to step, not what to restore: loading must keep ours."""
    model = str(tmp_path / "model")
    random_checkpoint(model, seed=2, num_hidden_layers=1)
    torchrun(2, "tests/helpers/resume_flags.py", model, str(tmp_path / "run"))
    assert (tmp_path / "run" / "ok").read_text() == "ok"
