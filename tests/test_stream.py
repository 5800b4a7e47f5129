"""--stream: the continuous pool (engines/pool.py) and the streaming rollout rank (roles/stream.py)."""
import io
import json
import os
import sys

import pytest
import torch
from launch import torchrun
from test_checkpoint import same_run, start_and_kill_rank_1
from test_train_grpo import TINY, metrics
from test_vllm import needs_vllm, run_helpers

from engines.decode import SamplingParams
from engines.native import NativeEngine
from engines.pool import Pool, Request
from models.hf import iter_checkpoint, read_config
from models.tokenizer import Tokenizer
from tasks.data import load_rows
from utils import checkpoint

MODEL = "assets/carries-tiny"  # completions of 40-200 tokens: rows end at very different steps


@pytest.fixture(scope="module")
def carries():
    tok = Tokenizer(MODEL)
    engine = NativeEngine(read_config(MODEL), tok)
    engine.load_weights(iter_checkpoint(MODEL))
    rows = load_rows("builtin:carries", "eval", "prompt", None)[:6]
    return engine, [tok.encode(*tok.render(r["prompt"])) for r in rows]


def drain(pool: Pool, requests: list[Request], until=None) -> dict:
    """Admit as rows free up and step until every request ended (or `until` steps): {key: Samples}."""
    got, queue, steps = {}, list(requests), 0
    while (queue or pool.live) and steps != until:
        k = min(len(queue), pool.free // pool.params.n)
        pool.admit(queue[:k])
        queue = queue[k:]
        got.update({req.key: s for req, s in pool.step()})
        steps += 1
    return got


@pytest.mark.reordered
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_pool_gives_a_batchs_tokens(carries, temperature):
    """Fewer rows than samples, so that samples are admitted as others end, at their own lengths:
    each sample's tokens are those of one batch (the same uniforms by seed, j and position), its
    log-probs equal to rounding: the pool's attention reads a longer masked cache and its batches have
    other shapes, so its sums run in another order (2.9e-6 apart here, at most; 1e-4 leaves room for
    other kernels: tests/helpers/runs.py's rule for log-probs)."""
    engine, prompts = carries
    params = SamplingParams(3, temperature, max_new_tokens=200)
    batch = engine.generate(prompts, params, list(range(len(prompts))))
    assert len(set(batch.lengths.tolist())) > 3  # lengths of every kind
    pool = Pool(engine, params, 7, max(map(len, prompts)) + 200)
    got = drain(pool, [Request((i,), p, i) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        s = got[(i,)]
        for j in range(3):
            row, L = i * 3 + j, int(batch.lengths[i * 3 + j])
            assert int(s.lengths[j]) == L and s.finish_reasons[j] == batch.finish_reasons[row]
            assert torch.equal(s.tokens[j, :L], batch.tokens[row, :L])
            torch.testing.assert_close(s.logprobs[j, :L], batch.logprobs[row, :L], rtol=0, atol=1e-4)
            assert s.texts[j] == batch.texts[row]
    assert pool.live == 0 and not pool.requests and not pool.ended


def teacher_forced(engine, prompt: list[int], tokens: list[int]):
    """log-probs [len(tokens)] of `tokens` after `prompt` under the engine's weights: one forward of the
    whole sequence (the training model's, not the decoder's)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = engine.model(ids, logits_from=len(prompt) - 1)[0, :-1]  # [len(tokens), V]
    return torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]


@pytest.mark.reordered
@pytest.mark.parametrize("drop", [False, True])
def test_an_update_in_flight_switches_the_next_token_to_the_new_version(carries, drop):
    """New weights between two decode steps: every later token is sampled under them, with their
    log-prob exactly (to rounding) the new version's given the tokens before it, while the earlier
    tokens keep the old version's; with drop, the live samples start over under the new weights."""
    engine, prompts = carries
    old = {k: v.clone() for k, v in iter_checkpoint(MODEL)}
    noise = torch.Generator().manual_seed(1)
    new = {k: v + 0.02 * torch.randn_like(v, generator=noise) for k, v in old.items()}
    params = SamplingParams(2, 1.0, max_new_tokens=200)
    pool = Pool(engine, params, 4, max(map(len, prompts)) + 200)
    requests = [Request((i,), p, i) for i, p in enumerate(prompts[:2])]
    engine.load_weights(old.items())
    engine.version = 0
    early = drain(pool, requests, until=20)
    assert not early and pool.live == 4  # every sample is still running
    engine.load_weights(new.items())
    engine.version = 1
    pool.refresh(drop=drop)
    got = drain(pool, [])
    for i, req in enumerate(requests):
        s = got[req.key]
        for j in range(2):
            L = int(s.lengths[j])
            versions, tokens = s.token_versions[j, :L], s.tokens[j, :L].tolist()
            if drop:  # started over: one version, the new one
                assert versions.tolist() == [1] * L
                engine.load_weights(new.items())
                torch.testing.assert_close(s.logprobs[j, :L], teacher_forced(engine, req.prompt, tokens),
                                           rtol=0, atol=1e-4)
                continue
            assert versions[:20].tolist() == [0] * 20 and versions[20:].tolist() == [1] * (L - 20)
            for weights, part in ((old, slice(0, 20)), (new, slice(20, L))):
                engine.load_weights(weights.items())
                forced = teacher_forced(engine, req.prompt, tokens)
                torch.testing.assert_close(s.logprobs[j, part], forced[part], rtol=0, atol=1e-4)
    engine.load_weights(old.items())  # (the module's engine, as it was)


def test_a_snapshot_restores_the_pool_exactly(carries):
    """state() mid-run, into a new pool, refreshed: the rest of the run is the same, bit for bit."""
    engine, prompts = carries
    params = SamplingParams(2, 1.0, max_new_tokens=200)
    context = max(map(len, prompts)) + 200
    requests = [Request((i,), p, i) for i, p in enumerate(prompts[:4])]

    def run_to_the_end(pool, queue):
        return {k: (s.tokens, s.logprobs) for k, s in drain(pool, queue).items()}

    a = Pool(engine, params, 4, context)
    first = drain(a, requests, until=30)
    state = torch.load(_saved(a.state()), weights_only=False)
    b = Pool(engine, params, 4, context)
    b.load(state)
    a.refresh()
    b.refresh()
    left = [r for r in requests if r.key not in first and r.key not in a.requests]
    rest_a, rest_b = run_to_the_end(a, left), run_to_the_end(b, left)
    assert rest_a.keys() == rest_b.keys() and rest_a
    for k in rest_a:
        assert torch.equal(rest_a[k][0], rest_b[k][0]) and torch.equal(rest_a[k][1], rest_b[k][1])


def _saved(state):
    f = io.BytesIO()
    torch.save(state, f)
    f.seek(0)
    return f


BASE = [f for f in TINY if f not in ("--steps", "3")] + [
    "--steps", "8", "--placement", "disaggregate", "--rollout-ranks", "1", "--max-staleness", "1", "--stream"]
STREAM = [*BASE, "--save-every", "2", "--keep-last", "4"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("stream-straight"))
    torchrun(2, "train_grpo.py", *STREAM, "--run-dir", path)
    return path


def test_a_streaming_run_bounds_every_tokens_staleness(straight):
    """Every token of every step at most --max-staleness versions old, and some samples span two
    versions (partial rollouts: the update came while they ran)."""
    rows = [r for r in metrics(straight) if "rollout/token_staleness_max" in r]
    assert len(rows) == 8
    assert all(r["rollout/token_staleness_max"] <= 1 for r in rows)
    assert any(0 < r["rollout/token_staleness/1"] < 1 for r in rows)
    assert rows[0]["rollout/token_staleness_mean"] == 0  # step 0: version 0 only
    assert all(abs(sum(r[f"rollout/token_staleness/{k}"] for k in range(4)) - 1) < 1e-5 for r in rows)


def test_kill_9_of_the_rollout_rank_then_resume_is_exact(tmp_path, straight):
    """The rollout rank killed mid-stream, the job stopped: --resume auto restores the pool and the
    groups in flight from the newest complete checkpoint, and the run is the uninterrupted one bit for
    bit (metrics, the per-token staleness included, and the final weights)."""
    run = str(tmp_path / "killed")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "train_grpo.py", *STREAM, "--run-dir", run]
    log = tmp_path / "killed.log"
    p = start_and_kill_rank_1(cmd, run, log)
    # (torchrun stops the trainer; test_disaggregate.py tests what a trainer says alone)
    assert p.wait(timeout=120) != 0
    assert len(metrics(run)) < len(metrics(straight))
    newest = checkpoint.find(run)[0]
    held = torch.load(os.path.join(newest, "stream_rollout1.pt"), weights_only=False)
    assert held["pool"]["rows"] and held["queue"]  # it resumes with samples half made and prompts waiting
    out = torchrun(2, "train_grpo.py", *STREAM, "--resume", "auto", "--run-dir", run).stdout
    assert f"resumed from {newest}" in out
    same_run(straight, run)


def test_a_checkpoint_waits_for_the_rollout_ranks_snapshot(tmp_path):
    """meta.json's awaits: without the rollout rank's file the checkpoint is not complete."""
    for step, files in ((2, ["stream_rollout1.pt"]), (4, [])):
        d = tmp_path / "checkpoints" / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"step": step, "awaits": ["stream_rollout1.pt"]}))
        for f in files:
            (d / f).write_bytes(b"x")
    path, partial = checkpoint.find(str(tmp_path))
    assert os.path.basename(path) == "step_00000002"
    assert [os.path.basename(p) for p in partial] == ["step_00000004"]


def test_dynamic_sampling_and_the_decoupled_loss_on_the_stream(tmp_path):
    """--dynamic-sampling's waves go into the running pool (each step waits for its own), and AReaL's
    decoupled objective (--recompute-old-logp --mismatch tis: the clip around the recomputed policy,
    a truncated weight to each token's sampling version) trains on the tokens' own log-probs."""
    run = str(tmp_path / "ds")
    torchrun(2, "train_grpo.py", *BASE, "--dynamic-sampling", "--stream-swap", "asap", "--recompute-old-logp",
             "--mismatch", "tis",
             "--save-every", "0", "--run-dir", run)
    rows = [r for r in metrics(run) if "rollout/ds_waves" in r]
    assert len(rows) == 8 and any(r["rollout/ds_waves"] > 1 for r in rows)  # refills happened
    assert all(r["rollout/token_staleness_max"] <= 1 for r in rows)
    assert all(r["train/mismatch_weight_max"] <= 2.0 + 1e-6 for r in rows)  # truncated at --mismatch-high
    assert any(r["train/mismatch_kl"] > 0 for r in rows[1:])  # stale tokens: the versions differ


# fp32 log-probs, vLLM's CPU kernels against the trainer's model: on carries-tiny (rebuilt 2026-12-07,
# sharper than the first build) up to 1.02e-4 over a sample's tokens, under the default arithmetic
# order, RL_THREADS=2, MKL_CBWR=COMPATIBLE and ATEN_CPU_CAPABILITY=default (5.4e-5); the other
# version's are over 11 away. 5e-4 leaves 5x room for another CPU and stays far from a stale cache.
GAP = 5e-4


@pytest.mark.reordered
@needs_vllm
def test_vllms_pool_takes_an_update_in_flight_exactly():
    """engines/vllm_pool.py (tests/helpers/vllm_stream_check.py, both modes at once): new weights while
    vLLM's requests run. keep: each sample's first tokens are version 0's, the rest version 1's, and
    every log-prob is the trainer's model's under the version that sampled it (within GAP, fp32; the
    other version's are > 1e-2 away, so a stale cache would show); drop: the samples started over,
    all version 1. A held-out evaluation between the stream's steps runs under the new weights. A pool
    resumed from a snapshot of live requests (drop's helper: a checkpoint's pickle, a fresh pool) adds
    them again at its first update: they end whole, under the new version only, every log-prob the
    trainer's model's under it."""
    keep, drop = run_helpers(*(["tests/helpers/vllm_stream_check.py", MODEL, m] for m in ("keep", "drop")))
    for r in (keep, drop):
        assert r["early"] == 0  # every sample still ran when the update came
        for s in r["samples"]:
            assert s["gap"] < GAP and s["gap_other"] > 1e-2, s
            assert s["versions"] == sorted(s["versions"]), s  # version 0's tokens, then version 1's
        assert max(r["eval_gaps"]) < GAP and r["eval_version"] == 1, r
    assert all(set(s["versions"]) == {0, 1} for s in keep["samples"])  # went on under the new weights
    assert all(set(s["versions"]) == {1} for s in drop["samples"])  # started over
    resumed = drop["resumed"]
    assert resumed["early"] == 0 and resumed["waiting"] == 4, resumed  # both live when saved, held on load
    assert resumed["keys"] == [[2], [3]] and resumed["versions"] == [2] and resumed["gap"] < GAP, resumed
    tokens, rows = keep["big_batch"]
    assert tokens > 4096 and rows == 128  # a batch the CPU engine once failed on (chunked prefill)


@needs_vllm
def test_a_streaming_run_with_vllm(tmp_path):
    """--stream --engine vllm --stream-swap asap: vLLM's core in a process of its own, weights over the
    gloo transfer while its requests run, held-out evaluations in the stream: every token within K."""
    run = str(tmp_path / "vllm")
    torchrun(2, "train_grpo.py", *BASE, "--engine", "vllm", "--stream-swap", "asap", "--save-every", "0",
             "--run-dir", run, fresh=True)
    rows = [r for r in metrics(run) if "rollout/token_staleness_max" in r]
    assert len(rows) == 8 and all(r["rollout/token_staleness_max"] <= 1 for r in rows)
    assert any(r["rollout/token_staleness_mean"] > 0 for r in rows)  # the stream ran ahead of training
    assert sum("eval/accuracy" in r for r in metrics(run)) >= 2
