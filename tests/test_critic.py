"""The critic under torchrun (gloo): whitening over 2 ranks is the whole batch's; 2 ranks give the
1-rank value update; the value loss falls on a fixed batch."""
import os

import pytest
import torch
from safetensors.torch import load_file

from assets.make import random_checkpoint
from models.config import read_json
from rl import algos
from tests.helpers.runs import assert_same_by_norm
from tests.test_fsdp import torchrun


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random causal checkpoint: the critic starts from it with a zero value head."""
    path = str(tmp_path_factory.mktemp("rand"))
    random_checkpoint(path, seed=1, tie_word_embeddings=False, num_hidden_layers=2)
    return path


@pytest.mark.reordered
def test_whitening_over_two_ranks_equals_whitening_the_gathered_batch(tmp_path):
    """Each rank whitens its rows with the moments all-reduced over the ranks: the result is the
    whole batch whitened on one process. Rank 1's rows are longer and shifted, so whitening each
    rank by its own moments would differ."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 2, 1, 3, 6, 5, 6, 4])  # rows 0-3 on rank 0, 4-7 on rank 1
    mask = (torch.arange(6)[None] < lengths[:, None]).float()  # [8, 6]
    x = torch.randn(8, 6, generator=g) + torch.tensor([0.0] * 4 + [2.0] * 4)[:, None]
    x = torch.where(mask > 0, x, 1e4)  # garbage in the padding
    torch.save({"x": x, "mask": mask}, tmp_path / "batch.pt")
    out = str(tmp_path / "white")
    torchrun(2, "tests/helpers/whiten.py", str(tmp_path / "batch.pt"), out)
    got = torch.cat([torch.load(f"{out}.{r}") for r in range(2)])  # [8, 6]
    want = algos.whiten(x, mask, *algos.masked_moments(x, mask))
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
    assert (got[mask == 0] == 0).all()
    alone = algos.whiten(x[:4], mask[:4], *algos.masked_moments(x[:4], mask[:4]))  # rank 0's own moments
    assert not torch.allclose(alone, want[:4], atol=1e-2)  # the test would see per-rank whitening


@pytest.mark.reordered
def test_two_ranks_critic_steps_equal_one_rank(model_dir, tmp_path):
    """Two steps on one batch (the old values are the first rollout's, as in PPO's epochs), micro-
    batches of 2 rows: 1 and 2 ranks take the same steps, compared as reordered runs are
    (tests/helpers/runs.py). The fresh head is zero: every value is 0 at first, and the first step
    trains the head alone (the body's gradient is the head's weight times the loss's: exactly 0);
    the second trains the body too and meets the clip."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    torchrun(1, "tests/helpers/critic_step.py", model_dir, one, "2", "2", "rollout")
    torchrun(2, "tests/helpers/critic_step.py", model_dir, two, "2", "2", "rollout")
    before = load_file(os.path.join(model_dir, "model.safetensors"))
    for k in range(2):  # each step's gradients, before the optimizer: to rounding of their norm
        assert_same_by_norm(load_file(f"{one}.grads{k}"), load_file(f"{two}.grads{k}"))
    a, b = load_file(f"{one}.step0"), load_file(f"{two}.step0")
    assert a.keys() == b.keys() == (set(before) - {"lm_head.weight"}) | {"score.weight"}
    # the first step's weights, all of them: the body moved by the decay alone (an exact product),
    # and every head weight took Adam's whole first step (|g| >> eps), which rounding cannot move
    assert (a["score.weight"].abs() >= 0.95 * 1e-2).all() and (b["score.weight"].abs() >= 0.95 * 1e-2).all()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-5), (name, (a[name] - b[name]).abs().max())
    # not the second step's weights element by element: Adam divides a near-zero gradient's
    # rounding noise by its own size (one k_proj.bias element 2.5e-5 apart on an AVX-512 machine)
    first, second = load_file(f"{one}.step0"), load_file(f"{one}.step1")
    assert first["score.weight"].abs().min() > 1e-3  # the head left zero
    body = [name for name in first if name != "score.weight"]
    decay = 1 - 1e-2 * 0.1  # AdamW's weight decay, lr * weight_decay
    for name in body:  # the first step: a zero head passes no gradient to the body; only the decay moved it
        assert torch.allclose(first[name], before[name] * decay, rtol=0, atol=1e-7), name
    assert max((second[name] - first[name] * decay).abs().max().item() for name in body) > 1e-3

    logs = [read_json(f"{path}.json") for path in (one, two)]
    assert logs[0]["tokens"] == logs[1]["tokens"]
    tokens = logs[0]["tokens"]
    for log in logs:
        assert log["first_values_abs_max"] == 0.0  # the fresh head is zero: every value is 0
        for step in log["steps"]:  # train_step's sums are those of the loss on the same values
            assert step["value_loss"] == pytest.approx(step["want_loss"], rel=1e-5)
            assert step["value_clipped"] == step["want_clipped"]
        assert log["steps"][0]["value_clipped"] == 0  # values equal the old ones: nothing to clip
        assert 0 < log["steps"][1]["value_clipped"] / tokens < 1  # they moved, some past the clip
        assert log["steps"][1]["values_moved"] > 0.2  # the first step changed the values
        assert log["steps"][1]["value_loss"] < log["steps"][0]["value_loss"]
    for s1, s2 in zip(*(log["steps"] for log in logs)):
        assert s1["value_loss"] == pytest.approx(s2["value_loss"], rel=1e-5)
        assert s1["value_clipped"] == s2["value_clipped"]
        assert s1["grad_norm"] == pytest.approx(s2["grad_norm"], rel=1e-5)


def test_the_value_loss_falls_on_a_fixed_batch(model_dir, tmp_path):
    """Eight steps on one rank, each a new rollout of the same batch (old values = the current
    ones): the critic fits the returns."""
    out = str(tmp_path / "learn")
    torchrun(1, "tests/helpers/critic_step.py", model_dir, out, "8", "8", "refresh", "1e-3")
    steps = read_json(out + ".json")["steps"]
    losses = [s["value_loss"] for s in steps]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.5 * losses[0], losses
    assert all(s["values_moved"] > 0 for s in steps[1:])
