"""Disaggregated placement: layout checks, bucket plans, exact bucketed broadcast, the same run
as colocate at staleness 0, the staleness bound, and a dead rollout rank failing the trainers."""
import importlib.util
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from test_fsdp import ROOT, torchrun
from test_train_grpo import SEEDED, TINY, metrics, no_eval

import placement
from assets.make import random_checkpoint
from tests.helpers.runs import differences_within, weights_apart
from utils.dist import KeptBuffers, plan_buckets


def test_layout_says_what_fits():
    with pytest.raises(ValueError, match=r"fits: --rollout-ranks in \[1, 2\]"):
        placement.Layout("disaggregate", 4, dp=1, rollout_ranks=3)
    with pytest.raises(ValueError, match=r"fits: --rollout-ranks in \[1\]"):
        placement.Layout("disaggregate", 3, dp=1, rollout_ranks=2)  # 1 trainer cannot feed 2 rollout ranks
    with pytest.raises(ValueError, match="needs at least 2 ranks"):
        placement.Layout("disaggregate", 1, dp=1, rollout_ranks=0)
    with pytest.raises(ValueError, match="applies to --placement disaggregate only"):
        placement.Layout("colocate", 2, dp=1, rollout_ranks=1)
    with pytest.raises(ValueError, match="add --placement disaggregate"):
        placement.plan("colocate", 0, 2, torch.device("cpu"), 4, max_staleness=1)
    placement.Layout("disaggregate", 6, dp=4, rollout_ranks=2)  # fits: 2 trainers per rollout rank


@pytest.mark.parametrize("bucket_bytes", [1, 6, 64, 96, 1000, 10**9])
def test_bucket_plan_covers_every_tensor_once_within_the_bound(bucket_bytes):
    specs = [("a", (3, 5), torch.float32), ("b", (7,), torch.float32), ("c", (4, 4), torch.bfloat16),
             ("d", (2,), torch.float32), ("e", (24,), torch.float32)]
    buckets = plan_buckets(specs, bucket_bytes)
    covered = {name: [] for name, _, _ in specs}
    dtype_of = {name: dtype for name, _, dtype in specs}
    for dtype, numel, pieces in buckets:
        assert numel == sum(stop - start for _, start, stop in pieces)
        assert numel * dtype.itemsize <= max(bucket_bytes, dtype.itemsize)  # bounded bytes
        assert all(dtype_of[name] == dtype for name, _, _ in pieces)  # one dtype per bucket
        for name, start, stop in pieces:
            covered[name].append((start, stop))
    for name, shape, _ in specs:  # contiguous, in order, exactly once
        ranges = covered[name]
        assert ranges[0][0] == 0 and ranges[-1][1] == math.prod(shape)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    if bucket_bytes >= 10**9:
        assert len(buckets) == 3  # fp32 a, b | bf16 c | fp32 d, e: a dtype change closes a bucket


def test_kept_buffers_hand_memory_out_again_only_once_nothing_uses_it():
    pool = KeptBuffers(torch.device("cpu"))
    a = pool.take(torch.float32, 8)
    kept = a[2:6].view(2, 2)  # a consumer keeps a view of it (vLLM's reload keeps a layer's weights)
    del a
    b = pool.take(torch.float32, 8)
    assert b.data_ptr() != kept.data_ptr() - 2 * 4  # still in use: new memory
    first = kept.data_ptr() - 2 * 4
    del kept
    c = pool.take(torch.float32, 8)
    assert c.data_ptr() == first  # nothing uses it any more: the same memory again
    assert pool.take(torch.float32, 8).data_ptr() not in (first, b.data_ptr())  # b and c are both held
    assert pool.take(torch.bfloat16, 8).dtype == torch.bfloat16
    del b, c
    # three float32 buffers (the most alive at once), one bf16
    assert sum(len(v) for v in pool.free.values()) == 4


def test_broadcast_gives_every_rollout_rank_the_exact_weights(tmp_path):
    model = str(tmp_path / "model")
    random_checkpoint(model, seed=3, tie_word_embeddings=False, num_hidden_layers=2)
    w = load_file(os.path.join(model, "model.safetensors"))
    biggest = max(t.numel() * t.element_size() for t in w.values())
    smallest = min(t.numel() * t.element_size() for t in w.values())
    total = sum(t.numel() * t.element_size() for t in w.values())
    sizes = [smallest // 2, biggest, 2 * total]  # below any tensor, exactly the largest, the whole model
    torchrun(4, "tests/helpers/weight_sync.py", model, str(tmp_path), *map(str, sizes), timeout=180)
    for i in range(len(sizes)):
        sent = load_file(str(tmp_path / f"sent_sync{i}.safetensors"))
        assert set(sent) == set(w)
        for rank in (2, 3):
            got = load_file(str(tmp_path / f"rank{rank}_sync{i}.safetensors"))
            assert set(got) == set(sent)
            for k in sent:
                assert got[k].dtype == sent[k].dtype and torch.equal(got[k], sent[k]), (i, rank, k)
    assert not torch.equal(load_file(str(tmp_path / "sent_sync0.safetensors"))["model.norm.weight"],
                           load_file(str(tmp_path / "sent_sync1.safetensors"))["model.norm.weight"])


DISAGG = ["--placement", "disaggregate", "--rollout-ranks", "1"]


@pytest.mark.reordered
def test_on_policy_disaggregate_is_the_colocate_run(grpo_run, tmp_path):
    """Equivalence at --max-staleness 0: 2 trainers + 1 rollout rank vs colocate on 2 ranks
    (conftest.grpo_run: a reference model, a reward that fails now and then), same seed. Each
    step the same prompts go to the same trainer ranks with the same per-prompt seeds, and the
    rollout rank generates each trainer's batch separately (the batches a colocated engine
    sees), from weights broadcast exactly: so every non-timing metric (rewards, lengths, losses,
    gradient norms, held-out accuracy) and the final weights are the same, to rounding:
    utils/dist.py gives the 2 colocated ranks os.cpu_count() // 2 threads, the 3 disaggregated
    ones // 3, and a kernel may sum in another order on another thread count
    (tests/helpers/runs.py)."""
    co, dis = grpo_run[0], str(tmp_path / "dis")
    torchrun(3, "train_grpo.py", *SEEDED, *DISAGG, "--max-staleness", "0", "--run-dir", dis)
    a, b = metrics(co), metrics(dis)
    assert len(a) == 4 and differences_within(a, b) == []
    assert all(r["placement/staleness_max"] == 0 for r in b[:3])
    assert all(r["perf/sync_bytes"] > 0 for r in b[:3])
    wa = load_file(os.path.join(co, "final", "model.safetensors"))
    wb = load_file(os.path.join(dis, "final", "model.safetensors"))
    # last-bit noise in the gradients moves Adam's updates by about as much, relative: a run
    # with GEMMs of another summation order (MKL_CBWR=COMPATIBLE) ended 2.7e-5 of the update away
    apart = weights_apart(wa, wb, load_file("assets/arith-tiny/model.safetensors"))
    assert apart <= 1e-3, apart


def test_staleness_one_overlaps_and_stays_within_the_bound(tmp_path):
    run = str(tmp_path / "s1")
    flags = [*TINY, *DISAGG, "--max-staleness", "1", "--save-every", "2", "--run-dir", run]
    torchrun(3, "train_grpo.py", *flags, "--steps", "5")
    rows = [r for r in metrics(run) if not r.get("final")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    staleness = [r["placement/staleness_max"] for r in rows]
    assert max(staleness) <= 1
    assert staleness[0] == 0 and staleness[1:] == [1, 1, 1, 1]  # step k+1 was generated while step k trained
    for r in rows:
        for key in ("placement/trainer_busy_s", "placement/trainer_idle_s", "placement/rollout_busy_s",
                    "placement/rollout_idle_s", "placement/idle_share", "perf/sync_s", "perf/sync_bytes"):
            assert r[key] >= 0, key

    # the trainers' checkpoint (collective over the trainer ranks only) resumes; the pipeline
    # of requests sent ahead starts again, so the first resumed step is on-policy
    torchrun(3, "train_grpo.py", *flags, "--steps", "7", "--resume", "auto")
    rows = [r for r in metrics(run) if not r.get("final")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    assert [r["placement/staleness_max"] for r in rows[4:]] == [0, 1, 1]


@pytest.mark.parametrize("stream", [[], ["--stream", "--max-staleness", "1"]], ids=["batches", "stream"])
def test_a_dead_rollout_rank_fails_the_trainers_with_a_clear_error(tmp_path, stream):
    """The ranks are started by hand (not torchrun, which would kill the others itself) so that
    what the trainers do on their own is what is tested. stream: a --stream rollout rank dies while
    its pool runs."""
    run = str(tmp_path / "dead")
    # the store is hosted here, as torchrun's agent hosts it: bound to port 0 by the kernel, so no
    # other process can take its port between choosing it and binding it (bind 0, close, reuse)
    store = torch.distributed.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
           "TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}
    cmd = [sys.executable, "train_grpo.py", *no_eval(TINY), "--steps", "200", *DISAGG, *stream,
           "--timeout-s", "60", "--run-dir", run]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]
    try:
        deadline = time.time() + 120
        while not (os.path.exists(os.path.join(run, "metrics.jsonl")) and
                   os.path.getsize(os.path.join(run, "metrics.jsonl"))):
            assert time.time() < deadline and all(p.poll() is None for p in procs), "the run did not start"
            time.sleep(0.05)
        procs[2].send_signal(signal.SIGKILL)  # the rollout rank dies mid-run
        t = time.time()
        outs = [p.communicate(timeout=90) for p in procs[:2]]
        assert time.time() - t < 60  # well inside --timeout-s: a closed connection is seen at once
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode != 0 for p in procs[:2])
    said = outs[0][1] + outs[1][1]
    assert "rollout rank 2 stopped answering" in said, outs[0][1][-2000:]
    assert "--resume auto goes on from it" in said or "No checkpoint was saved" in said  # where it stands
    assert len(metrics(run)) < 200


@pytest.mark.parametrize("engine", ["native", pytest.param("vllm", marks=pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM not installed"))])
def test_sigterm_in_disaggregate_saves_and_stops_every_rank(tmp_path, engine):
    """Preemption: every worker gets SIGTERM. The rollout rank keeps serving, the trainers save
    their checkpoint at the step they stopped, collect the requests sent ahead and tell the
    rollout rank to stop: the job ends cleanly (vLLM's engine process included). native: 2
    trainers, staleness 1. vllm: 1 trainer, on-policy, the weights going into vLLM's worker over
    our gloo transfer after every step, so its log-probs stay the policy's."""
    from launch import start

    from utils import checkpoint

    run = str(tmp_path / "run")
    ranks, ahead = ("3", "1") if engine == "native" else ("2", "0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "train_grpo.py", *no_eval(TINY), "--steps", "200", *DISAGG, "--max-staleness", ahead,
           "--save-every", "0", "--run-dir", run, "--engine", engine]
    # vllm under torchrun itself: the rank starts vLLM's engine core, a process of its own
    p = start(cmd, open(tmp_path / "run.log", "w"), fresh=engine == "vllm")
    try:
        deadline = time.time() + 240
        while not os.path.exists(os.path.join(run, "metrics.jsonl")) or len(metrics(run)) < 3:
            assert p.poll() is None and time.time() < deadline, open(tmp_path / "run.log").read()[-3000:]
            time.sleep(0.05)
        for pid in p.ranks().values():
            os.kill(pid, signal.SIGTERM)
        assert p.wait(timeout=90) == 0, open(tmp_path / "run.log").read()[-3000:]
    finally:
        p.kill()
    path, _ = checkpoint.find(run)
    assert path is not None and int(os.path.basename(path).split("_")[1]) == len(metrics(run)) < 200
    if engine == "vllm":
        rows = metrics(run)
        assert rows[0]["train/rows_trained"] > 0  # the policy moved after step 1: a stale engine would show
        for r in rows[1:]:
            assert 0 <= r["train/logprob_gap_mean"] <= r["train/logprob_gap_max"] < 1e-3
