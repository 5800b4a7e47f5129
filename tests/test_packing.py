"""models/packing.py: packed micro-batches (rows back to back, a group's prompt once) against the
padded forward, for the log-probs, values and scores the roles read, and their gradients."""
import pytest
import torch

from models import packing
from models.config import ModelConfig
from models.decoder import completion_logprobs, completion_values, sequence_scores
from models.hf import build
from models.packing import plan_bins, split_to
from tasks.data import forward_batches, make_batch, scatter_rows, take_rows
from tests.helpers.runs import assert_same_by_norm


def tiny(scores: bool = False, seed: int = 0):
    """A 2-layer GQA model of 64 tokens: a tied LM, or with one score head (critic, reward model)."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      tie_word_embeddings=not scores,
                      architecture="Qwen2ForSequenceClassification" if scores else "Qwen2ForCausalLM",
                      pad_token_id=0 if scores else None)
    model = build(cfg)
    model.init_weights(seed=seed)
    return model


def grouped_batch(seed: int = 0):
    """Groups of 3, 2, 1 and 4 samples of prompts of 3, 7, 1 and 5 tokens (left-padded to 7), with
    completions of 1 to 9 tokens (right-padded), the groups' rows interleaved; an advantage per row."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 7, 1, 5)]
    prompts = [base[i] for i in (0, 1, 0, 2, 3, 3, 1, 0, 3, 3)]
    N = len(prompts)
    tokens = torch.randint(1, 64, (N, 9), generator=g)
    lengths = torch.tensor([9, 2, 5, 1, 3, 8, 6, 4, 9, 7])
    batch = make_batch(prompts, tokens, lengths, 0)
    batch["adv"] = torch.randn(N, 1, generator=g).expand(N, 9)
    return batch


def run(model, batch, fn, size: int, tokens: int):
    """fn's per-row results through forward_batches [N, T] (0 where cut), the summed gradient of
    sum(result * adv * loss_mask), and the micro-batches' packed sequence lengths (0: padded)."""
    model.zero_grad()
    parts, lengths = [], []
    for rows, mb in forward_batches(batch, size, tokens):
        out = fn(model, mb)  # [n, T']
        (out * mb["adv"][:, :out.shape[1]] * mb["loss_mask"]).sum().backward()
        parts.append((rows, out.detach()))
        lengths.append(mb["packed"]["input_ids"].shape[1] if "packed" in mb else 0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return scatter_rows(parts, *batch["loss_mask"].shape), grads, lengths


def logprobs(model, mb):
    return completion_logprobs(model, mb, 0.8)


@pytest.mark.reordered
@pytest.mark.parametrize("budget,expected", [
    (10 ** 6, True),  # one sequence: the 4 prompts once (3 + 7 + 1 + 5 tokens) and the completions
    (24, False),  # several sequences, a group's rows together while they fit
    (1, False),  # a row per sequence: packing without any sharing
])
def test_packed_logprobs_and_gradients_equal_the_padded_forward(budget, expected):
    """The same log-probs (fp32 rounding: 1e-5 relative) and every parameter's gradient to 1e-5 of
    its norm (tests/helpers/runs.py: sums over other widths round otherwise), for groups of mixed
    completion lengths, a group of one, prompts of 1 to 7 tokens left-padded. One packed sequence
    holds each prompt once: 16 prompt tokens where the padded batch runs 10 x 7."""
    model, batch = tiny(), grouped_batch()
    padded, padded_grads, _ = run(model, batch, logprobs, 256, 0)
    packed, packed_grads, lengths = run(model, batch, logprobs, 256, budget)
    mask = batch["loss_mask"] > 0
    assert torch.allclose(packed[mask], padded[mask], rtol=1e-5, atol=1e-6)
    assert_same_by_norm(packed_grads, padded_grads)
    if expected:
        assert lengths == [16 + int(batch["loss_mask"].sum())] == [16 + 54]
    if budget == 1:  # every row alone, with its own prompt
        assert len(lengths) == 10 and sum(lengths) == int(batch["valid"].sum())


@pytest.mark.reordered
def test_packed_values_and_scores_equal_the_padded_forward():
    """The critic's values of each state (completion_values) and the reward model's score of each
    sequence (sequence_scores, read at its last non-pad token, here one whose completion ends in
    the pad id as HF does), packed as padded, and their gradients."""
    model, batch = tiny(scores=True), grouped_batch()
    batch["input_ids"][2, batch["prompt_len"] + 4] = 0  # row 2's last completion token is the pad id
    padded, padded_grads, _ = run(model, batch, completion_values, 256, 0)
    packed, packed_grads, _ = run(model, batch, completion_values, 256, 20)
    mask = batch["loss_mask"] > 0
    assert torch.allclose(packed[mask], padded[mask], rtol=1e-5, atol=1e-6)
    assert_same_by_norm(packed_grads, padded_grads)

    def scores(model, mb):
        return sequence_scores(model, mb)[:, None]  # [n, 1]: run() weighs it by adv and loss_mask
    padded, padded_grads, _ = run(model, batch, scores, 256, 0)
    packed, packed_grads, _ = run(model, batch, scores, 256, 20)
    assert torch.allclose(packed[:, 0], padded[:, 0], rtol=1e-5, atol=1e-6)
    assert_same_by_norm(packed_grads, padded_grads)


def test_a_completion_that_sees_another_of_its_group_is_caught(monkeypatch):
    """The mutation the comparison must catch: each completion also attending to the completion
    packed before it (the same prompt's sibling) moves log-probs far past the tolerance."""
    model, batch = tiny(), grouped_batch()
    padded, _, _ = run(model, batch, logprobs, 256, 0)
    grouped = packing.buckets

    def leaky(pieces, waste):
        seen, last = [], {}
        for spans in pieces:  # in sequence order
            if len(spans) == 2 and spans[0] in last:  # a completion after a sibling: see the sibling too
                spans = (spans[0], last[spans[0]], spans[1])
            if len(spans) >= 2:
                last[spans[0]] = spans[-1]
            seen.append(spans)
        return grouped(seen, waste)
    monkeypatch.setattr(packing, "buckets", leaky)
    packed, _, _ = run(model, batch, logprobs, 256, 10 ** 6)
    mask = batch["loss_mask"] > 0
    assert (packed[mask] - padded[mask]).abs().max() > 1e-2


def test_bins_keep_a_group_together_and_count_its_prompt_once():
    """plan_bins: rows of one prompt key go together (in order of the key's first row), a prompt is
    counted once per bin, a row over the budget is a bin of its own; split_to halves the bin of most
    rows until there are as many as another rank's, and says what to change when it cannot."""
    keys = ["a", "b", "a", "c", "a"]
    bins = plan_bins(keys, [10, 4, 10, 6, 10], [5, 3, 5, 20, 5], budget=25)
    assert bins == [[0, 2, 4], [1], [3]]  # a: 10 + 3 x 5 = 25; b: 4 + 3 = 7, and c (26) would make 33
    assert plan_bins(keys, [10, 4, 10, 6, 10], [5, 3, 5, 20, 5], budget=1) == [[0], [2], [4], [1], [3]]
    assert plan_bins(keys, [10, 4, 10, 6, 10], [5, 3, 5, 20, 5], budget=100, rows=2) == [[0, 2], [4, 1], [3]]
    assert split_to(bins, 4) == [[0], [2, 4], [1], [3]]
    assert split_to([[0], [1]], 3) == [[0], [1]]  # one row each: forward_batches adds idle ones


def test_a_rank_with_too_few_rows_runs_idle_micro_batches(monkeypatch):
    """Ranks of unequal rows (a reward model's scoring waves): when another rank needs more packed
    micro-batches than this one's rows can make, this one runs the rest on its first row with no
    token in the loss and no row to write to (the padded path ran one micro-batch per 256 rows, so
    these ranks could hang or run unlike forwards)."""
    from tasks import data

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group: 2)
    monkeypatch.setattr(data, "reduce", lambda values, op, group: {"bins": 5.0})  # the other rank's plan
    batch = grouped_batch()
    parts = list(forward_batches(take_rows(batch, slice(0, 3)), 256, 10 ** 6, group="trainers"))
    assert len(parts) == 5
    assert [len(rows) for rows, _ in parts] == [1, 1, 1, 0, 0]  # split to one row each, then two idle
    for rows, mb in parts[3:]:
        assert mb["loss_mask"].sum() == 0 and rows.device.type == "cpu"
        logp = completion_logprobs(tiny(), mb, 1.0)
        assert torch.isfinite(logp).all()
    assert scatter_rows([(r, torch.ones(len(r) or 1, 2)) for r, _ in parts], 3, 2).eq(1).all()
