"""FSDP2 under torchrun (gloo): 2 ranks give the 1-rank update; gathered weights are exact."""
import os

import pytest
import torch
from launch import ROOT, torchrun  # noqa: F401 (the suite's torchrun: tests import both from here)
from safetensors.torch import load_file

from assets.make import random_checkpoint
from tests.helpers.runs import assert_same_by_norm, assert_same_first_step


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


@pytest.mark.reordered
@pytest.mark.parametrize("loss_agg,micro", [("token", 2), ("sequence", 8)])
def test_two_ranks_update_equals_one_rank(model_dir, step, loss_agg, micro):
    """The same rows' sums on 1 and 2 ranks (tests/helpers/runs.py): the gradients to rounding of
    their norm, and the weights that took Adam's whole first step."""
    one, two = step(1, loss_agg, micro), step(2, loss_agg, micro)
    a, b = load_file(one), load_file(two)
    before = load_file(os.path.join(model_dir, "model.safetensors"))
    assert_same_by_norm(load_file(one + ".grads"), load_file(two + ".grads"))
    assert_same_first_step(a, b, before, lr=1e-2)
    assert any(not torch.equal(a[k], before[k]) for k in a)  # the step did change the weights
    assert open(one + ".gather_ok").read() == "True" and open(two + ".gather_ok").read() == "True"


@pytest.mark.reordered
def test_packed_micro_batches_on_two_ranks_equal_padded_rows_on_one(model_dir, step):
    """--micro-batch-tokens 9 (models/packing.py: rows back to back, a group's prompt once) on 2
    ranks whose own plans need different numbers of micro-batches: both run the larger number (FSDP
    pairs its gathers), and the update is the padded 1-rank step's, to rounding of the norms."""
    one, two = step(1, "token", 2), step(2, "token", "t9")
    planned, runs = open(two + ".micro").read().rsplit(" ", 1)
    planned = [int(x) for x in planned.strip("[]").split(",")]
    assert planned[0] != planned[1] and int(runs) == max(planned)
    assert_same_by_norm(load_file(one + ".grads"), load_file(two + ".grads"))
    before = load_file(os.path.join(model_dir, "model.safetensors"))
    assert_same_first_step(load_file(one), load_file(two), before, lr=1e-2)


@pytest.mark.reordered
def test_a_compiled_step_is_the_eager_step(model_dir, step, tmp_path):
    """--compile (torch.compile of each decoder block, under FSDP2 on 2 ranks): the same update,
    compared as reordered runs are (tests/helpers/runs.py: inductor fuses and orders the sums its
    own way): the gradients to rounding of their norm, the weights that took Adam's whole step."""
    eager, compiled = step(2, "token", 2), str(tmp_path / "compiled.safetensors")
    torchrun(2, "tests/helpers/fsdp_step.py", model_dir, compiled, "token", "2", "compile", timeout=600)
    assert int(open(compiled + ".graphs").read()) >= 1  # dynamo compiled the blocks
    assert open(compiled + ".gather_ok").read() == "True"  # the HF names and values are intact
    a, b = load_file(eager), load_file(compiled)
    before = load_file(os.path.join(model_dir, "model.safetensors"))
    assert_same_by_norm(load_file(eager + ".grads"), load_file(compiled + ".grads"))
    assert_same_first_step(a, b, before, lr=1e-2)
    up = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(b[up], before[up])


@pytest.mark.reordered
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
    # skipping rows changes which rows share a micro-batch: the same sums in other groupings
    assert_same_by_norm({k: g[f"skip.{k}"] for k in names}, {k: g[f"full.{k}"] for k in names})
