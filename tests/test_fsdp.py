"""FSDP2 under torchrun (gloo): 2 ranks give the 1-rank update; gathered weights are exact."""
import os

import pytest
import torch
from safetensors.torch import load_file

from launch import ROOT, torchrun  # noqa: F401 (the suite's torchrun: tests import both from here)
from utils.tiny import random_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rand"))
    random_checkpoint(path, seed=1, tie_word_embeddings=False, num_hidden_layers=2)
    return path


@pytest.fixture(scope="module")
def step(model_dir, tmp_path_factory):
    """step(ranks, loss_agg, micro): the weights file after one FSDP step of
    tests/helpers/fsdp_step.py, each launched once for this module (the 2-rank token step is
    both the 1-rank comparison's and the compiled step's eager run)."""
    done = {}

    def run(nproc, loss_agg, micro):
        if (nproc, loss_agg, micro) not in done:
            path = str(tmp_path_factory.mktemp("step") / f"{nproc}-{loss_agg}-{micro}.safetensors")
            torchrun(nproc, "tests/helpers/fsdp_step.py", model_dir, path, loss_agg, str(micro))
            done[nproc, loss_agg, micro] = path
        return done[nproc, loss_agg, micro]
    return run


def assert_same_first_step(a, b, before, lr):
    """Two first AdamW steps from `before` (dicts of weights) are one update. Adam's first step is
    lr * g / (|g| + eps), eps 1e-8: +-lr wherever |g| >> eps, and there the two must agree to rounding
    (1e-5 is 0.1% of the step; measured up to 1.7e-6). Where |g| is within ~20 eps of 0 (a gradient
    that cancels, e.g. k_proj.bias's, which softmax ignores: 0 in exact arithmetic), the step is
    rounding noise divided by ~eps, and the same sums in another order (other ranks, or other
    micro-batches: utils.data.forward_batches groups rows by length) move it anywhere in +-lr: those
    weights (10-13% in these tests) are not compared. A row lost or counted twice moves the
    gradient by a share of its size and flips the steps of the weights whose gradient was that close
    to 0, ~2e-2 apart."""
    assert a.keys() == b.keys()
    full = total = 0
    for k in a:
        full_step = ((a[k] - before[k]).abs() >= 0.95 * lr) & ((b[k] - before[k]).abs() >= 0.95 * lr)
        assert torch.allclose(a[k][full_step], b[k][full_step], rtol=0, atol=1e-5), \
            (k, (a[k] - b[k])[full_step].abs().max())
        full, total = full + int(full_step.sum()), total + full_step.numel()
    assert full > 0.8 * total, full / total  # most weights took a whole step: the check covers them


@pytest.mark.parametrize("loss_agg,micro", [("token", 2), ("sequence", 8)])
def test_two_ranks_update_equals_one_rank(model_dir, step, loss_agg, micro):
    one, two = step(1, loss_agg, micro), step(2, loss_agg, micro)
    a, b = load_file(one), load_file(two)
    before = load_file(os.path.join(model_dir, "model.safetensors"))
    assert a.keys() == b.keys()
    assert_same_first_step(a, b, before, lr=1e-2)
    assert any(not torch.equal(a[k], before[k]) for k in a)  # the step did change the weights
    assert open(one + ".gather_ok").read() == "True" and open(two + ".gather_ok").read() == "True"


def test_a_compiled_step_is_the_eager_step(model_dir, step, tmp_path):
    """--compile (torch.compile of each decoder block, under FSDP2 on 2 ranks): the same update.
    Adam's first step is ~lr * sign(g) = 1e-2 per weight, so a gradient that differs in the
    last bits near 0 moves a weight by up to ~1e-5 more or less: 1e-4 is 1% of the step."""
    eager, compiled = step(2, "token", 2), str(tmp_path / "compiled.safetensors")
    torchrun(2, "tests/helpers/fsdp_step.py", model_dir, compiled, "token", "2", "compile", timeout=600)
    assert int(open(compiled + ".graphs").read()) >= 1  # dynamo compiled the blocks
    assert open(compiled + ".gather_ok").read() == "True"  # the HF names and values are intact
    a, b = load_file(eager), load_file(compiled)
    before = load_file(os.path.join(model_dir, "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-4), (k, (a[k] - b[k]).abs().max())
    up = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(b[up], before[up])


def test_zero_advantage_rows_are_skipped_with_the_same_gradient(model_dir, tmp_path):
    """Rows with advantage 0 add nothing to the loss: skipping them leaves the gradient as it was,
    and every rank trains the same number of rows (the most any rank needs) so FSDP pairs up."""
    import json

    out = str(tmp_path / "grads.safetensors")
    torchrun(2, "tests/helpers/skip_rows.py", model_dir, out)
    rows = json.load(open(out + ".rows"))
    assert rows["skip"] == {"rows0": 3, "rows1": 3} and rows["full"] == {"rows0": 6, "rows1": 6}
    g = load_file(out)
    names = [k.removeprefix("skip.") for k in g if k.startswith("skip.")]
    assert names and all(f"full.{k}" in g for k in names)
    # Skipping rows changes which rows share a micro-batch, so each gradient is the same sum
    # taken in other groupings: it differs by rounding, ~eps (1.2e-7) times the size of the
    # terms summed, whatever the element's own value (which may cancel to ~0) or the tensor's
    # largest one. The tensor's norm is that size: GEMMs of another order (MKL_CBWR=COMPATIBLE)
    # measured 4e-7 of it; a row dropped or weighted wrongly moves it by a share of ~1/6.
    for k in names:
        a, b = g[f"skip.{k}"], g[f"full.{k}"]
        assert (a - b).norm() <= 1e-5 * b.norm(), (k, ((a - b).norm() / b.norm()).item())
    assert any(g[f"full.{k}"].abs().max() > 0 for k in names)  # there was a gradient to compare
