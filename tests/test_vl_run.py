"""A vision-language policy (Qwen2-VL, models/qwen2_vl.py) through the native engine and training:
what the engine samples from image prompts is what the trainer scores, micro-batches that split a
batch of images change nothing, a vision weight reaches the engine, and a GRPO step on
builtin:squares trains every parameter (the tower's too, unless --freeze-vision), the same in
colocate and disaggregate."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_disaggregate import DISAGG
from test_fsdp import ROOT, torchrun
from test_train_grpo import metrics

from assets.make import vl_config
from engines.decode import SamplingParams
from engines.native import NativeEngine
from models.decoder import completion_logprobs
from models.hf import build, save_model
from models.tokenizer import Tokenizer
from tasks.data import load_rows, make_batch, micro_batches, per_sample, tokenize_rows
from tasks.squares import NAME
from tests.helpers.runs import differences_within


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    """A random tiny Qwen2-VL (assets.make's shape) with the squares task's tokenizer."""
    path = str(tmp_path_factory.mktemp("vl"))
    cfg = vl_config(path)
    model = build(cfg)
    model.init_weights(seed=3, std=0.1)  # wide: samples differ from row to row
    save_model(model, cfg, path)
    return path


def prompts(path):
    """Three image prompts of different sizes and one text-only prompt, left-padded together."""
    tok = Tokenizer(path)
    rows = tokenize_rows(load_rows(NAME, "eval", "prompt", "answer")[:12], tok, 256)[0]
    sizes, picked = set(), []
    for r in rows:
        if r["images"][0].shape not in sizes and len(picked) < 3:
            sizes.add(r["images"][0].shape)
            picked.append(r["ids"])
    text = tok.encode(*tok.render([{"role": "user", "content": "How many red squares?"}]))
    return tok, picked + [text]


@pytest.mark.reordered
def test_the_native_engine_samples_what_the_trainer_scores_from_image_prompts(vl_dir):
    """Same weights, same math (prefill with the image features spliced in, M-RoPE positions, then
    1-D decoding from each prompt's deltas): the engine's log-probs of its own samples equal the
    trainer's forward over prompt + completion to float rounding (the engine's fused, packed
    matmuls sum in another order; measured ~1e-6). Micro-batches of 5 rows cut through a prompt's
    samples and mix text-only rows with image rows: each row's images go with it."""
    from models.hf import iter_checkpoint, load_model

    tok, ids = prompts(vl_dir)
    assert [len(p.grids) for p in ids[:3]] == [1, 1, 1] and not hasattr(ids[3], "grids")
    engine = NativeEngine(load_model(vl_dir).config, tok)
    engine.load_weights(iter_checkpoint(vl_dir))
    n = 3
    out = engine.generate(ids, SamplingParams(n, 1.0, max_new_tokens=6), seeds=[1, 2, 3, 4])
    assert len(set(map(tuple, out.tokens.tolist()))) > 6  # the samples differ
    batch = make_batch(per_sample(ids, n), out.tokens, out.lengths, tok.pad_id)
    assert sum(x is not None for x in batch["images"]) == 9  # the text prompt's 3 rows have none
    assert batch["images"][0][0] is batch["images"][2][0]  # made once per prompt: the tower runs once
    model = load_model(vl_dir)
    mask = batch["loss_mask"] > 0
    with torch.no_grad():
        whole = completion_logprobs(model, batch, 1.0)  # [12, T]
        parts = torch.cat([completion_logprobs(model, mb, 1.0) for mb in micro_batches(batch, 5)])
    assert (whole - out.logprobs).abs()[mask].max() < 1e-4
    assert (parts - whole).abs()[mask].max() < 1e-5

    # a vision weight reaches the engine: the same seeds then give other log-probs on image rows only
    weights = dict(iter_checkpoint(vl_dir))
    weights["visual.blocks.0.attn.qkv.weight"] = weights["visual.blocks.0.attn.qkv.weight"] * 1.5
    engine.load_weights(iter(weights.items()))
    again = engine.generate(ids, SamplingParams(n, 1.0, max_new_tokens=6), seeds=[1, 2, 3, 4])
    first = torch.stack([out.logprobs[:, 0], again.logprobs[:, 0]])  # [2, 12] the first token's
    assert (first[0, :9] - first[1, :9]).abs().min() > 0  # every image row moved
    assert torch.equal(first[0, 9:], first[1, 9:])  # the text rows did not


RUN = ["--dataset", NAME, "--steps", "2", "--prompts-per-step", "4", "--num-generations", "4",
       "--max-new-tokens", "6", "--eval-every", "0", "--lr", "1e-2", "--warmup-steps", "1",
       "--rewards", "accuracy", "tests.helpers.rewards:length_bonus"]


def moved(run: str, start: dict) -> set:
    """The names of the tensors the run's final weights changed."""
    end = load_file(os.path.join(run, "final", "model.safetensors"))
    return {k for k in start if not torch.equal(start[k], end[k])}


@pytest.mark.reordered
def test_grpo_on_squares_trains_every_parameter_alike_in_colocate_and_disaggregate(vl_dir, tmp_path):
    """Two GRPO steps on builtin:squares (a reward that varies with the completion's length, so
    every group has advantages): every parameter moves, the vision tower's included; with
    --freeze-vision (and dynamic sampling's waves) the tower's do not and the rest do.
    Disaggregated (the prompts, images included, travel to the rollout rank) at staleness 0 is the
    colocated run, to rounding (tests/helpers/runs.py). A frozen run resumes; not without the flag."""
    start = load_file(os.path.join(vl_dir, "model.safetensors"))
    co, dis, frozen = (str(tmp_path / k) for k in ("co", "dis", "frozen"))
    torchrun(2, "train_grpo.py", "--model", vl_dir, *RUN, "--run-dir", co)
    assert moved(co, start) == set(start)
    assert any(k.startswith("visual.blocks.") for k in start)
    torchrun(3, "train_grpo.py", "--model", vl_dir, *RUN, *DISAGG, "--max-staleness", "0", "--run-dir", dis)
    a, b = metrics(co), metrics(dis)
    assert len(a) == 3 and differences_within(a, b) == []
    frozen_run = ["train_grpo.py", "--model", vl_dir, *RUN, "--freeze-vision", "--dynamic-sampling",
                  "--save-every", "1", "--run-dir", frozen]
    torchrun(2, *frozen_run, "--steps", "1")
    assert moved(frozen, start) == {k for k in start if not k.startswith("visual.")}

    # a resume goes on from the checkpoint (the frozen tower is not in it: --model's is read again);
    # one without the flag it was trained with is refused, in one line
    out = torchrun(2, *frozen_run, "--steps", "2", "--resume", "auto").stdout
    assert "continuing at step 2" in out
    assert [r["step"] for r in metrics(frozen) if not r.get("final")] == [0, 1]
    assert moved(frozen, start) == {k for k in start if not k.startswith("visual.")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           *[f for f in frozen_run if f != "--freeze-vision"], "--steps", "3", "--resume", "auto"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("error:")]
    assert p.returncode != 0 and len(errors) == 1 and "trained with --freeze-vision" in errors[0], errors
