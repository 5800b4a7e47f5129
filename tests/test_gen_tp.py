"""--gen-tp K (engines/tp.py): colocated ranks generate tensor-parallel in groups of K while
training stays FSDP2 over all of them. The pair's engine gives the whole engine's tokens and
log-probs (to float rounding: the row-parallel sums add the same products in another order), a
run with it is the run without it, and what it does not fit is refused with what would."""
import os
import sys

import pytest
import torch
import tyro
from test_fsdp import ROOT, torchrun

from tests.helpers.runs import differences_within
from utils.errors import UserError
from utils.logger import read_metrics

# one held-out prompt: rank 1 has none to evaluate, and still takes part in its pair's generation
RUN = ["--steps", "4", "--prompts-per-step", "8", "--num-generations", "4", "--eval-every", "2",
       "--eval-prompts", "1", "--max-new-tokens", "6", "--lr", "1e-3", "--warmup-steps", "1"]


@pytest.mark.reordered
def test_a_pair_generates_what_one_engine_does(tmp_path):
    """Each of 2 ranks generates its own prompts (other lengths, so other left padding than the
    pair's joint batch) with a whole native engine and with the --gen-tp 2 pair: greedy and
    sampled (3 per prompt, seeded per prompt) tokens and lengths equal, log-probs within 1e-5
    (the all-reduced partial sums differ from one matmul's in the last bits, ~1e-6 measured); a
    rank without prompts still takes part and gets none."""
    torchrun(2, os.path.join("tests", "helpers", "gen_tp_check.py"), "assets/arith-tiny", str(tmp_path))
    for rank, rows in ((0, 3), (1, 2)):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name in ("greedy", "sampled"):
            assert torch.equal(got[f"k1_{name}_tokens"], got[f"k2_{name}_tokens"]), (rank, name)
            assert torch.equal(got[f"k1_{name}_lengths"], got[f"k2_{name}_lengths"]), (rank, name)
            gap = (got[f"k1_{name}_logprobs"] - got[f"k2_{name}_logprobs"]).abs().max()
            assert 0 <= gap < 1e-5, (rank, name, gap)
        assert len(got["k1_greedy_lengths"]) == rows
        assert int(got["k2_alone_rows"]) == (rows if rank == 0 else 0)


@pytest.mark.reordered
def test_a_run_with_gen_tp_is_the_run_without(tmp_path):
    """2 ranks, colocate: --gen-tp 2 against the whole engine on each rank. The samples are the
    same (rewards, lengths, held-out accuracy equal); the losses and gradient norms agree to
    1e-4 (tests/helpers/runs.py, with 10x its room: the engine's log-probs, which the ratio
    reads, differ in the last bits, and so does every Adam step after them, over 4 steps)."""
    a, b = str(tmp_path / "one"), str(tmp_path / "pair")
    torchrun(2, "train_grpo.py", *RUN, "--run-dir", a)
    torchrun(2, "train_grpo.py", *RUN, "--gen-tp", "2", "--run-dir", b)
    ma, mb = (read_metrics(os.path.join(d, "metrics.jsonl")) for d in (a, b))
    assert len(ma) == 5 and differences_within(ma, mb, rel=1e-4) == []
    for x, y in zip(ma, mb):
        for k in x:
            if k.startswith(("rollout/", "eval/")):
                assert x[k] == y[k], (x["step"], k)


def refused(*flags, world=2) -> str:
    sys.path.insert(0, ROOT)
    from train_grpo import Args, check_args

    with pytest.raises(UserError) as e:
        check_args(tyro.cli(Args, args=[*RUN, *flags]), world)
    return str(e.value)


def test_what_gen_tp_does_not_fit_is_refused():
    assert "groups of K ranks must split the 2 ranks; fits: --gen-tp in [1, 2]" in refused("--gen-tp", "3")
    said = refused("--gen-tp", "4", world=4)  # arith-tiny: 4 heads, 2 key-value heads
    assert "the model's 2 key-value heads do not split over 4 ranks; fits: --gen-tp in [1, 2]" in said
    said = refused("--gen-tp", "2", "--placement", "disaggregate", "--rollout-ranks", "1", world=3)
    assert "--gen-tp 2: it splits colocated generation, which --placement disaggregate has not" in said
    assert "--gen-tp 2 with LoRA: the adapters are not split" in refused("--gen-tp", "2", "--lora-rank", "4")
