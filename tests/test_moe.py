"""Qwen3-MoE (models/moe.py): logits against transformers, export and reload, the native engine
against the trainer, routing replay, the routing metrics and losses, FSDP2 on 2 ranks, the flags."""
import dataclasses
import os

import pytest
import torch
from conftest import hf_checkpoint
from launch import torchrun
from safetensors.torch import load_file

from assets.make import random_checkpoint
from engines.decode import SamplingParams
from engines.native import NativeEngine
from models.config import Moe
from models.decoder import attention_mask, completion_logprobs, positions_from
from models.hf import build, iter_checkpoint, load_model, read_config, save_model
from models.moe import MoeArgs, Routing
from models.tokenizer import Tokenizer
from tasks.data import forward_batches, make_batch, scatter_rows
from tests.helpers.runs import assert_same_by_norm, assert_same_first_step
from utils.errors import UserError

MOE = dict(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)
CONFIGS = [  # (overrides): top-k renormalised or not, every layer sparse or every other, a dense first layer
    dict(norm_topk_prob=True, tie_word_embeddings=True),
    dict(norm_topk_prob=False, decoder_sparse_step=2, num_experts_per_tok=3, tie_word_embeddings=False),
    dict(norm_topk_prob=True, mlp_only_layers=[0], num_key_value_heads=1, num_hidden_layers=3),
]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.reordered
@pytest.mark.parametrize("kw", CONFIGS)
def test_logits_match_transformers_on_a_padded_batch(tmp_path, kw):
    ref = hf_checkpoint(str(tmp_path), "qwen3_moe", **{**MOE, **kw})
    ours = load_model(str(tmp_path))
    sparse = [layer.sparse for layer in ours.model.layers]
    assert sparse == [ref.config.num_experts > 0 and i not in ref.config.mlp_only_layers
                      and (i + 1) % ref.config.decoder_sparse_step == 0 for i in range(len(sparse))]
    x = torch.randint(0, 512, (3, 12))
    valid = torch.ones(3, 12, dtype=torch.bool)
    valid[1, :5] = False
    with torch.no_grad():
        got = ours(x, positions_from(valid), attention_mask(valid))
        want = ref(x, attention_mask=valid.long(), position_ids=positions_from(valid)).logits
    assert rel_err(got[valid], want[valid]) < 1e-5


def tiny_moe(path: str, seed: int = 1, router_std: float = 0.3, **moe):
    """A random Qwen3-MoE checkpoint (the tiny shape, 8 experts, top-2) with decisive routers."""
    random_checkpoint(path, seed=seed, architecture="Qwen3MoeForCausalLM",
                      moe=Moe(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                 "norm_topk_prob": True, **moe}))
    model = load_model(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in (layer for layer in model.model.layers if layer.sparse):
            layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g) * router_std)
    save_model(model, model.config, path)
    return model


def test_export_reloads_in_transformers_and_back(tmp_path):
    import transformers

    model = tiny_moe(str(tmp_path / "a"), mlp_only_layers=(1,))
    again = load_model(str(tmp_path / "a"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    cfg = read_config(str(tmp_path / "a"))
    assert cfg.moe == Moe(8, 2, 64, True, 1, (1,)) and cfg.architecture == "Qwen3MoeForCausalLM"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "a")).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.config.num_experts == 8
    x = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        assert rel_err(model(x), hf(x).logits) < 1e-5
    hf.save_pretrained(str(tmp_path / "b"))  # transformers' own save reads back as the same model
    saved_by_hf = dataclasses.replace(read_config(str(tmp_path / "b")), extra={})
    assert saved_by_hf == dataclasses.replace(cfg, extra={})


def test_qwen2_moe_is_refused_in_one_line(tmp_path):
    hf_checkpoint(str(tmp_path), "qwen3_moe", **MOE)
    import json

    path = tmp_path / "config.json"
    d = json.loads(path.read_text())
    path.write_text(json.dumps({**d, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}))
    with pytest.raises(UserError, match="Qwen2-MoE .*shared expert.* not supported.*Qwen3-MoE"):
        read_config(str(tmp_path))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moe"))
    tiny_moe(path)
    return path


def sample(path: str, dtype=torch.float32, temperature: float = 0.0, n: int = 2, T: int = 12, prompts=None):
    """(batch with the engine's routes, the engine's samples) of the native engine recording routes."""
    tok = Tokenizer(path)
    engine = NativeEngine(read_config(path), tok, dtype=dtype, routes=True)
    engine.load_weights(iter_checkpoint(path))
    prompts = prompts or [tok.encode(p) for p in ("12+34=", "5+6=", "99+1=", "7+70=")]
    params = SamplingParams(n, temperature, max_new_tokens=T)
    out = engine.generate(prompts, params, list(range(len(prompts))))
    batch = make_batch([p for p in prompts for _ in range(n)], out.tokens, out.lengths, tok.pad_id,
                       routes=out.routes)
    return batch, out


def gap(logp, out, batch):
    return ((logp - out.logprobs).abs() * batch["loss_mask"]).max().item()


def test_the_native_engine_equals_the_trainer_at_temperature_0(moe_dir):
    """Greedy samples of the fused decoder (engines/decode.py) against the trainer's forward: the
    log-probs within 1e-5, with and without the engine's routes, padded and packed."""
    batch, out = sample(moe_dir)
    model = load_model(moe_dir)
    assert len(out.routes) == 8 and out.routes[0].shape[1:] == (4, 2)
    with torch.no_grad():
        assert gap(completion_logprobs(model, batch, 1.0), out, batch) <= 1e-5
        assert gap(completion_logprobs(model, batch, 1.0, replay=True), out, batch) <= 1e-5
        parts = [(rows, completion_logprobs(model, mb, 1.0, replay=True))
                 for rows, mb in forward_batches(batch, 256, 40)]
    assert len(parts) > 1 and all("routes" in mb["packed"] for _, mb in forward_batches(batch, 256, 40))
    assert gap(scatter_rows(parts, *batch["loss_mask"].shape), out, batch) <= 1e-5


def own_routes(model, batch, replay: bool):
    """The experts each sparse block used in a forward over the batch -> [N, L, layers, k] (-1: dense)."""
    blocks = [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if layer.sparse]
    for _, b in blocks:
        b.record = []
    with torch.no_grad():
        completion_logprobs(model, batch, 1.0, replay)
    N, L = batch["input_ids"].shape
    used = torch.full((N, L, len(model.model.layers), 2), -1, dtype=torch.long)
    for i, b in blocks:
        used[:, :, i] = b.record.pop()
        b.record = None
    return used


def test_replay_uses_exactly_the_engines_experts(moe_dir):
    """Routes that differ from the trainer's own choice (the engine's, shuffled between tokens) are
    the experts the trainer's forward runs; tokens without a route (-1) keep the router's choice;
    the gradient reaches the router through the replayed experts' gates."""
    batch, out = sample(moe_dir, temperature=1.0)
    model = load_model(moe_dir)
    own = own_routes(model, batch, replay=False)
    routes = batch["routes"].long()
    known = routes >= 0
    assert torch.equal(own[known], routes[known])  # an fp32 engine routes as the trainer does
    g = torch.Generator().manual_seed(0)
    shuffled = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(routes[..., 0].numel())])
    batch["routes"] = torch.where(known, shuffled.view(routes.shape), -1).to(torch.int16)
    batch["routes"][:, :5] = -1  # the first columns left to the router (and all before them: causal)
    used = own_routes(model, batch, replay=True)
    replayed = batch["routes"].long() >= 0
    assert torch.equal(used[replayed], batch["routes"].long()[replayed])
    assert torch.equal(used[:, :5], own[:, :5])
    assert not torch.equal(used, own)
    logp = completion_logprobs(model, batch, 1.0, replay=True)
    (logp * batch["loss_mask"]).sum().backward()
    assert all(layer.mlp.gate.weight.grad.abs().sum() > 0 for layer in model.model.layers)


def test_a_bf16_engine_is_closer_to_the_trainer_with_replay(moe_dir):
    """An engine in bf16 routes some tokens to other experts than the fp32 trainer (0.9% of routes on
    this random model): replaying its experts leaves only the rounding, so the log-prob gap is smaller.
    The sum is mostly bf16's rounding, which replay cannot remove: it was 5-9% lower with replay, the
    max 2x lower, under three arithmetic orders (ATEN_CPU_CAPABILITY default and avx2 with
    MKL_ENABLE_INSTRUCTIONS=AVX2, 1 and 2 threads); the test asks only that both be lower."""
    batch, out = sample(moe_dir, dtype=torch.bfloat16, temperature=1.0, n=8, T=24)
    model = load_model(moe_dir)
    own = own_routes(model, batch, replay=False)
    known = batch["routes"] >= 0
    flipped = (own[known] != batch["routes"].long()[known]).float().mean().item()
    assert flipped > 0  # the premise: bf16 routing differs somewhere
    mask = batch["loss_mask"]
    with torch.no_grad():
        plain = (completion_logprobs(model, batch, 1.0) - out.logprobs).abs() * mask
        replay = (completion_logprobs(model, batch, 1.0, replay=True) - out.logprobs).abs() * mask
    assert replay.sum() < plain.sum() and replay.max() < plain.max()


def test_routing_metrics_load_balancing_loss_and_frozen_router(moe_dir):
    """Routing's counts are the blocks' choices; its load-balancing loss is transformers' for the
    same router logits; --freeze-router leaves the routers without gradients."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = load_model(moe_dir)
    routing = Routing(model, MoeArgs(router_aux_coef=0.5))
    x = torch.randint(0, 512, (3, 10))
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: logits.append(o.detach()))
             for layer in model.model.layers]
    routing.start()
    model(x)
    for h in hooks:
        h.remove()
    want = load_balancing_loss_func(tuple(logits), 8, 2)
    assert abs(routing.aux_loss().item() - 0.5 * want.item()) < 1e-5
    sums = routing.sums()
    assert sums["moe_tokens"] == 4 * 30 and sum(sums[f"moe_load/{e}"] for e in range(8)) == 4 * 30 * 2
    chosen = torch.cat([torch.softmax(z, -1).topk(2, -1).indices.flatten() for z in logits])
    assert [sums[f"moe_load/{e}"] for e in range(8)] == torch.bincount(chosen, minlength=8).tolist()
    frozen = load_model(moe_dir)
    Routing(frozen, MoeArgs(freeze_router=True))
    frozen(x).sum().backward()
    assert all(layer.mlp.gate.weight.grad is None for layer in frozen.model.layers)
    assert all(layer.mlp.experts[0].up_proj.weight.grad is not None for layer in frozen.model.layers)


def test_the_memory_plan_and_flops_know_the_experts(moe_dir):
    cfg = read_config(moe_dir)
    total, active = cfg.num_params(), cfg.num_params(active=True)
    assert total == sum(p.numel() for p in build(cfg).parameters())
    experts = 4 * 6 * 3 * 128 * 64  # 4 layers, 6 experts a token does not run, 3 matrices of 128 x 64
    assert total - active == experts


@pytest.mark.reordered
def test_two_ranks_update_equals_one_rank(moe_dir, tmp_path):
    """One FSDP2 step (tests/helpers/fsdp_step.py) of the MoE model, packed micro-batches: 2 ranks
    give the 1-rank gradients to rounding of their norm and the weights of Adam's first step; every
    expert of every block, routed to or not, is reduced (an expert with no tokens has a zero gradient)."""
    out = {n: str(tmp_path / f"{n}.safetensors") for n in (1, 2)}
    for n in (1, 2):
        torchrun(n, "tests/helpers/fsdp_step.py", moe_dir, out[n], "token", "t9", timeout=300)
    before = load_file(os.path.join(moe_dir, "model.safetensors"))
    assert_same_by_norm(load_file(out[1] + ".grads"), load_file(out[2] + ".grads"))
    assert_same_first_step(load_file(out[1]), load_file(out[2]), before, lr=1e-2)
    assert open(out[2] + ".gather_ok").read() == "True"


def test_flags_that_need_or_refuse_experts(moe_dir, tmp_path):
    from train_grpo import Args

    dense = str(tmp_path / "dense")
    random_checkpoint(dense, seed=0)
    args = Args()
    args.data.model, args.moe.routing_replay = dense, True
    with pytest.raises(UserError, match="--routing-replay: --model .* is a dense model"):
        args.moe.check_model(read_config(dense), args, "native")
    args = Args()
    args.data.model, args.lora.lora_rank = moe_dir, 8
    with pytest.raises(UserError, match="--lora-rank with a mixture-of-experts --model"):
        args.moe.check_model(read_config(moe_dir), args, "native")
    args = Args()
    args.data.model, args.moe.routing_replay = moe_dir, True  # --engine auto, which a GPU makes vLLM
    with pytest.raises(UserError, match=r"--routing-replay with --engine auto \(here: vllm\)"):
        args.moe.check_model(read_config(moe_dir), args, "vllm")
    args.moe.check_model(read_config(moe_dir), args, "native")  # on CPU: the native engine
    args.moe.router_aux_coef, args.moe.freeze_router = 0.01, True
    with pytest.raises(UserError, match="--router-aux-coef with --freeze-router"):
        args.moe.check_model(read_config(moe_dir), args, "native")


def test_kill_9_then_resume_is_exact_with_routing_replay(moe_dir, tmp_path):
    """A MoE run with --routing-replay: 6 steps straight == a run killed (kill -9 of a rank) after its
    first checkpoint and resumed with --resume auto (the routes are made again with the samples, from
    the prompts' seeds: nothing of them is checkpointed)."""
    import sys

    from test_checkpoint import FLAGS, same_run, start_and_kill_rank_1
    from test_train_grpo import metrics

    flags = [*FLAGS[:-4], "--steps", "6", "--save-every", "2", "--model", moe_dir, "--routing-replay"]
    assert FLAGS[-4:] == ["--steps", "10", "--save-every", "2"]  # (test_checkpoint's, cut to 6 steps)
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    torchrun(2, "train_grpo.py", *flags, "--run-dir", straight)
    trained = [r for r in metrics(straight) if "train/moe_replayed" in r]
    assert len(trained) == 6 and all(r["train/moe_replayed"] > 0.5 for r in trained)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "train_grpo.py", *flags, "--run-dir", killed]
    p = start_and_kill_rank_1(cmd, killed, tmp_path / "killed.log")
    assert p.wait(timeout=120) != 0
    assert len(metrics(killed)) < len(metrics(straight))
    resumed = torchrun(2, "train_grpo.py", *flags, "--resume", "auto", "--run-dir", killed)
    assert "resumed from" in resumed.stdout
    same_run(straight, killed)


@pytest.mark.parametrize("script,ranks,placement", [("train_grpo.py", 3, ["--placement", "disaggregate",
                                                                           "--rollout-ranks", "1"]),
                                                     ("train_ppo.py", 2, [])])
def test_replay_in_disaggregate_grpo_and_in_ppo(moe_dir, tmp_path, script, ranks, placement):
    """The routes travel from a rollout rank to its trainer with the samples (disaggregate), and PPO
    trains a MoE policy (and its MoE critic, a Qwen3MoeForSequenceClassification) with replay: the
    trainer replays nearly every token, and its log-probs are the fp32 engine's."""
    from test_train_grpo import TINY, metrics, no_eval
    from test_train_ppo import PPO_TINY

    flags = no_eval(TINY if script == "train_grpo.py" else PPO_TINY)
    torchrun(ranks, script, *flags, "--model", moe_dir, "--routing-replay", *placement,
             "--run-dir", str(tmp_path), timeout=300)
    rows = [r for r in metrics(str(tmp_path)) if "train/moe_replayed" in r]
    assert len(rows) == 3 and all(r["train/moe_replayed"] > 0.5 for r in rows)
    assert all(r["train/logprob_gap_max"] < 1e-4 for r in rows)
    # the shares sum to 1 up to the metrics file's rounding: 6 decimals each, so 8 of them within 8 x 5e-7
    sums = [sum(r[f"train/moe_load/{e}"] for e in range(8)) for r in rows]
    assert all(abs(total - 1) <= 8 * 5e-7 + 1e-9 for total in sums), sums


def test_the_tiny_moe_is_made_the_same_bytes_twice(tmp_path):
    """python -m assets.make --moe (a few supervised steps): the same bytes each time, a Qwen3-MoE with
    assets.make.TINY_MOE's experts."""
    import subprocess
    import sys

    from launch import ROOT

    from assets.make import TINY_MOE

    for out in ("a", "b"):
        cmd = [sys.executable, "-m", "assets.make", "--moe", "--sft-steps", "5", "--out", str(tmp_path / out)]
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=300, capture_output=True)
    a, b = (open(tmp_path / out / "model.safetensors", "rb").read() for out in ("a", "b"))
    assert a == b and read_config(str(tmp_path / "a")).moe == TINY_MOE
