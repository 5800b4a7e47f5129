"""LoRA (models/lora.py): adapters on our model, only they train under FSDP2, the engine gets the
merged weights, the reference is the actor with adapters off, checkpoints hold the adapters and
resume exactly, and the export loads in transformers + peft (or merged, in transformers alone)."""
import importlib.util
import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint import start_and_kill_rank_1
from test_fsdp import torchrun
from test_train_grpo import TINY, metrics

from assets.make import random_checkpoint
from models.hf import load_model, read_config
from models.lora import LoraArgs, add, count, initial, merged, scales
from utils.errors import UserError

LORA = ["--lora-rank", "8", "--lora-alpha", "16", "--lr", "3e-3"]


@pytest.mark.reordered
def test_with_b_zero_the_model_is_the_base_and_merging_equals_the_adapters():
    torch.manual_seed(0)
    base = load_model("assets/arith-tiny")
    model = load_model("assets/arith-tiny")
    add(model, LoraArgs(lora_rank=4, lora_alpha=8.0))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in initial(model, seed=1):
            params[name].copy_(t)
    x = torch.randint(1, 500, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x), base(x))  # B = 0: x A^T B^T adds exact zeros
        for name, p in params.items():
            if name.endswith("lora_B"):
                p.normal_(0, 0.05)
        adapted = model(x)
        merged_model = load_model("assets/arith-tiny")
        merged_model.load_state_dict(dict(merged(model.state_dict().items(), scales(model))), strict=False)
        # W + s B A rounded to fp32 once against the two products apart: a few fp32 eps per layer's
        # output, through 4 layers to logits of size ~5 (measured up to 1.2e-5)
        assert (merged_model(x) - adapted).abs().max() < 1e-4
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in params if n.endswith(("lora_A", "lora_B"))}
    assert len(trainable) == 4 * 7 * 2  # 4 layers, 7 linears, A and B


@pytest.mark.reordered
def test_the_native_engine_keeps_its_base_and_merges_each_version_of_the_adapters():
    """An engine given the base once and then adapters samples what an engine given the merged
    weights samples, bit for bit (both merge W + s B A with the same fp32 ops, then decode with the
    same ops), for two versions of the adapters; `release` keeps the base (not the merged copy)."""
    from engines.decode import SamplingParams
    from engines.native import NativeEngine
    from models.hf import read_config
    from models.lora import is_adapter
    from models.tokenizer import Tokenizer

    model = load_model("assets/arith-tiny")
    add(model, LoraArgs(lora_rank=4, lora_alpha=8.0, lora_targets="q_proj,v_proj,up_proj,down_proj"))
    cfg, tok, s = read_config("assets/arith-tiny"), Tokenizer("assets/arith-tiny"), scales(model)
    prompts, params = [tok.encode("12+34="), tok.encode("7*8=")], SamplingParams(n=3, max_new_tokens=12)
    kept = NativeEngine(cfg, tok)
    kept.load_weights((n, t) for n, t in model.state_dict().items() if not is_adapter(n))
    for version in range(2):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if is_adapter(name):
                    p.normal_(0, 0.3)
        whole = NativeEngine(cfg, tok)
        whole.load_weights(merged(model.state_dict().items(), s))
        kept.load_adapters(((n, t) for n, t in model.state_dict().items() if is_adapter(n)), s)
        want, got = whole.generate(prompts, params, [5, 6]), kept.generate(prompts, params, [5, 6])
        assert torch.equal(want.tokens, got.tokens) and torch.equal(want.logprobs, got.logprobs)
        kept.release()
        assert kept.model is not None and kept.decoder.step_layers is None
    base = load_model("assets/arith-tiny").state_dict()
    assert all(torch.equal(t, base[n]) for n, t in kept.model.state_dict().items())


def test_a_target_that_matches_nothing_is_named():
    with pytest.raises(UserError, match=r"--lora-targets q_proj,qq_proj: \['qq_proj'\] matches no linear"):
        LoraArgs(lora_rank=4, lora_targets="q_proj,qq_proj").check()


@pytest.mark.reordered
def test_fsdp_trains_only_the_adapters_and_the_engine_gets_the_merged_weights(tmp_path):
    """2 ranks, 3 optimizer steps: every base tensor is bit for bit the checkpoint's, every adapter
    moved; the engine's stream is the base's names, in weight_specs' order, each W + (alpha/r) B A."""
    model_dir, out = str(tmp_path / "rand"), str(tmp_path / "after.safetensors")
    random_checkpoint(model_dir, seed=1, tie_word_embeddings=False, num_hidden_layers=2)
    torchrun(2, "tests/helpers/lora_step.py", model_dir, out, "q_proj,v_proj,down_proj")
    after, engine = load_file(out), load_file(out + ".engine")
    trained, in_order = open(out + ".txt").read().split()
    base = load_model(model_dir).state_dict()
    adapters = {k for k in after if k.endswith(("lora_A", "lora_B"))}
    assert len(adapters) == 2 * 3 * 2 and int(trained) == sum(after[k].numel() for k in adapters)
    assert all(torch.equal(after[k], base[k]) for k in after if k not in adapters)
    start = dict(initial(_with_adapters(model_dir), seed=3))
    assert all(not torch.equal(after[k], start[k]) for k in adapters)
    assert set(engine) == set(base) and in_order == "True"
    for prefix in {k.rsplit(".", 1)[0] for k in adapters}:
        want = base[f"{prefix}.weight"] + 2.0 * after[f"{prefix}.lora_B"] @ after[f"{prefix}.lora_A"]
        assert (engine[f"{prefix}.weight"] - want).abs().max() < 1e-6


def _with_adapters(model_dir):
    model = load_model(model_dir)
    add(model, LoraArgs(lora_rank=4, lora_alpha=8.0, lora_targets="q_proj,v_proj,down_proj"))
    return model


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory):
    """6 GRPO steps with LoRA and a KL term (the reference: the actor, adapters off), checkpoints
    at 3 and 6, the PEFT export at the end."""
    run = str(tmp_path_factory.mktemp("lora") / "run")
    flags = [f for f in TINY if f not in ("--steps", "3")]
    torchrun(2, "train_grpo.py", *flags, *LORA, "--steps", "6", "--save-every", "3", "--kl-coef", "0.05",
             "--run-dir", run)
    return run, flags


def test_a_lora_run_trains_follows_its_engine_and_exports_a_peft_adapter(lora_run):
    import peft
    import transformers

    run, _ = lora_run
    rows = [r for r in metrics(run) if not r.get("final")]
    cfg = read_config("assets/arith-tiny")  # the colocated engine: the base once, then adapters alone
    adapter_bytes = 4 * count(cfg, LoraArgs(lora_rank=8))
    base_bytes = 4 * cfg.num_params()
    assert [r["perf/sync_bytes"] for r in rows] == [base_bytes + adapter_bytes] + [adapter_bytes] * 5
    assert rows[0]["train/kl"] == 0  # the first update's samples: the adapters (B = 0) change nothing yet
    assert rows[-1]["train/kl"] > 0 and all(r["train/logprob_gap_max"] < 1e-4 for r in rows)
    final = os.path.join(run, "final")
    assert sorted(os.listdir(final))[:2] == ["adapter_config.json", "adapter_model.safetensors"]
    x = torch.randint(1, 500, (2, 7))
    base = transformers.AutoModelForCausalLM.from_pretrained("assets/arith-tiny")
    theirs = peft.PeftModel.from_pretrained(base, final)
    ours = load_model("assets/arith-tiny")
    add(ours, LoraArgs(lora_rank=8, lora_alpha=16.0))
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for k, v in load_file(os.path.join(final, "adapter_model.safetensors")).items():
            params[k.removeprefix("base_model.model.").removesuffix(".weight")].copy_(v)
        assert (theirs(x).logits - ours(x)).abs().max() < 1e-5
        plain = transformers.AutoModelForCausalLM.from_pretrained("assets/arith-tiny")  # peft wrapped `base`
        assert (plain(x).logits - ours(x)).abs().max() > 1e-3  # the adapters did change the policy


def test_checkpoints_hold_the_adapters_and_merge_on_export_loads_in_plain_transformers(lora_run, tmp_path):
    """The DCP checkpoint has the adapters and their Adam moments, no base tensor; a run resumed at
    its last step exports the merged model, whose logits in transformers are the PEFT model's."""
    import peft
    import transformers

    from utils.checkpoint import SafeReader

    run, flags = lora_run
    step6 = os.path.join(run, "checkpoints", "step_00000006")
    keys = SafeReader(step6).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(k.endswith(("lora_A", "lora_B")) for k in model_keys), model_keys[:4]
    again = str(tmp_path / "again")
    shutil.copytree(os.path.join(run, "checkpoints"), os.path.join(again, "checkpoints"))
    out = torchrun(2, "train_grpo.py", *flags, *LORA, "--steps", "6", "--kl-coef", "0.05", "--run-dir", again,
                   "--resume", "auto", "--merge-on-export").stdout
    assert "resumed from" in out
    x = torch.randint(1, 500, (2, 7))
    with torch.no_grad():
        plain = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(again, "final"))(x).logits
        base = transformers.AutoModelForCausalLM.from_pretrained("assets/arith-tiny")
        adapted = peft.PeftModel.from_pretrained(base, os.path.join(run, "final"))(x).logits
    # merged, W + s B A is rounded to fp32 once per weight, against x W^T + s (x A^T) B^T computed apart:
    # a few fp32 eps of each layer's output, through 4 layers to logits of size ~5 (measured 1.2e-5)
    assert (plain - adapted).abs().max() < 1e-4


def test_kill_9_then_resume_is_exact_with_lora(lora_run, tmp_path):
    run, flags = lora_run
    killed = str(tmp_path / "killed")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "train_grpo.py", *flags, *LORA, "--steps", "6", "--save-every", "3", "--kl-coef", "0.05",
           "--run-dir", killed]
    p = start_and_kill_rank_1(cmd, killed, tmp_path / "killed.log")
    assert p.wait(timeout=120) != 0
    torchrun(2, "train_grpo.py", *flags, *LORA, "--steps", "6", "--save-every", "3", "--kl-coef", "0.05",
             "--run-dir", killed, "--resume", "auto")
    assert [r["step"] for r in metrics(killed)] == [r["step"] for r in metrics(run)]
    from utils.logger import differences

    assert differences(metrics(run), metrics(killed)) == []
    a = load_file(os.path.join(run, "final", "adapter_model.safetensors"))
    b = load_file(os.path.join(killed, "final", "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ppo_with_a_lora_actor_runs(tmp_path):
    from test_train_ppo import PPO_TINY

    run = str(tmp_path / "ppo")
    torchrun(2, "train_ppo.py", *PPO_TINY, *LORA, "--run-dir", run)
    rows = [r for r in metrics(run) if not r.get("final")]
    assert len(rows) >= 2 and all(r["train/logprob_gap_max"] < 1e-4 for r in rows)
    assert os.path.isfile(os.path.join(run, "final", "adapter_model.safetensors"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
@pytest.mark.parametrize("mode", ["merged", "adapters"])
def test_vllm_follows_a_lora_policy_in_both_modes(tmp_path, mode):
    """vLLM in the rank's process, three updates. merged: it gets W + (alpha/r) B A through the weight
    transfer (the full weights' bytes); adapters: it serves the adapters on its own base (a PEFT
    directory, a new id each version: the adapters' bytes). Either way the log-probs it reports for
    its samples are the trainer's (the LoRA forward) within 1e-4."""
    run = str(tmp_path / "v")
    flags = [f for f in TINY if f not in ("--eval-every", "2", "--eval-prompts", "8")]
    torchrun(2, "train_grpo.py", *flags, *LORA, "--engine", "vllm", "--lora-vllm", mode, "--eval-every", "0",
             "--run-dir", run, timeout=600)
    rows = [r for r in metrics(run) if not r.get("final")]
    assert len(rows) == 3 and all(r["train/logprob_gap_max"] < 1e-4 for r in rows)
    cfg = read_config("assets/arith-tiny")
    want = 4 * (cfg.num_params() if mode == "merged" else count(cfg, LoraArgs(lora_rank=8)))
    assert [r["perf/sync_bytes"] for r in rows] == [want] * 3


def test_disaggregated_native_engines_get_the_base_once_then_only_adapter_bytes(tmp_path):
    """3 ranks (2 trainers, 1 native rollout rank): the first sync sends the base weights, unmerged,
    and the adapters; every later one the adapters alone (r (in + out) fp32 values per target), which
    the rollout rank merges into its base: its log-probs stay the trainer's within 1e-4."""
    run = str(tmp_path / "dis")
    flags = [f for f in TINY if f not in ("--steps", "3")]
    torchrun(3, "train_grpo.py", *flags, *LORA, "--steps", "4", "--placement", "disaggregate",
             "--rollout-ranks", "1", "--run-dir", run)
    rows = [r for r in metrics(run) if not r.get("final")]
    cfg = read_config("assets/arith-tiny")
    adapter_bytes = 4 * count(cfg, LoraArgs(lora_rank=8))
    base_bytes = 4 * cfg.num_params()  # a tied head counted once, as it is sent
    assert [r["perf/sync_bytes"] for r in rows] == [base_bytes + adapter_bytes] + [adapter_bytes] * 3
    assert all(r["train/logprob_gap_max"] < 1e-4 for r in rows)
