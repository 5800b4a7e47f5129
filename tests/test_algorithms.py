"""Every choice of the algorithm menu end to end: train_grpo.py on 2 ranks (gloo, with timeouts)
finishes, logs its metrics and changes the weights. Each run joins an advantage to an
objective, a reward shaping or a mismatch correction (Dr. GRPO keeps grpo's advantage, whose
--no-scale-std it is), so that every choice runs once in five launches; the math itself is
tested against plain loops in test_algos_menu.py."""
import os

import pytest
import torch
from safetensors.torch import load_file
from test_fsdp import torchrun
from test_train_grpo import metrics

FLAGS = ["--steps", "2", "--prompts-per-step", "4", "--num-generations", "4", "--eval-every", "0",
         "--max-new-tokens", "6", "--lr", "1e-3", "--warmup-steps", "1"]
RUNS = [  # (flags, the metrics the choices must log)
    (["--no-scale-std", "--loss-agg", "constant"], ["train/pg_loss"]),  # Dr. GRPO (scale_std is grpo's)
    (["--overlong-buffer", "3", "--mask-truncated", "--max-new-tokens", "4",
      "--advantage", "reinforce++_baseline"], ["rollout/reward/overlong", "train/pg_loss"]),
    (["--policy-loss", "gspo", "--loss-agg", "sequence", "--mismatch", "tis",
      "--advantage", "rloo", "--recompute-old-logp"], ["train/mismatch_weight_max", "perf/old_logp_s"]),
    (["--policy-loss", "cispo", "--mismatch", "mis", "--mismatch-level", "sequence",
      "--advantage", "reinforce++", "--kl-coef", "0.05", "--kl-estimator", "k1"],
     ["train/mismatch_seq_share", "perf/reference_s"]),
    (["--policy-loss", "dual_clip", "--mismatch", "icepop", "--mismatch-level", "geometric",
      "--advantage", "remax"], ["train/mismatch_kl", "train/pg_loss"]),
]


@pytest.mark.parametrize("flags,keys", RUNS, ids=[" ".join(f)[:48] for f, _ in RUNS])
def test_each_algorithm_runs_logs_and_trains(tmp_path, flags, keys):
    run = str(tmp_path / "run")
    torchrun(2, "train_grpo.py", *FLAGS, *flags, "--run-dir", run)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 1] and rows[-1]["final"]
    for key in keys:
        assert all(key in r for r in rows[:2]), key
    assert all(torch.isfinite(torch.tensor(r["train/grad_norm"])) for r in rows[:2])
    before = load_file("assets/arith-tiny/model.safetensors")
    after = load_file(os.path.join(run, "final", "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
