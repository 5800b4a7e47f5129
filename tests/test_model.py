"""models/decoder.py against transformers: logits, checkpoints, errors."""
import dataclasses
import json
import os
import re

import pytest
import torch
from conftest import hf_checkpoint

from models.config import ModelConfig
from models.decoder import attention_mask, positions_from
from models.hf import build, iter_checkpoint, load_model, read_config, save_model
from tests.helpers.runs import assert_same_by_norm

# Llama 3.1's RoPE scaling with a short original context, so that the 16 frequencies of a 32-dim
# head fall in all three bands (kept, interpolated, stretched)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

CONFIGS = [  # (arch, overrides): GQA ratios, tied/untied, bias on/off, rope theta
    ("qwen2", dict(tie_word_embeddings=True)),
    ("qwen2", dict(num_key_value_heads=4, tie_word_embeddings=False, rope_theta=1e6)),
    ("qwen2", dict(num_key_value_heads=1, head_dim=64, rope_theta=500.0)),
    ("llama", dict(num_key_value_heads=1, tie_word_embeddings=False)),
    ("llama", dict(attention_bias=True, tie_word_embeddings=True, rope_theta=1e5)),
    ("llama", dict(rope_parameters=LLAMA3, tie_word_embeddings=False)),
    ("qwen3", dict(tie_word_embeddings=True)),  # per-head q/k RMSNorm, no bias
    ("qwen3", dict(num_key_value_heads=1, head_dim=64, attention_bias=True, tie_word_embeddings=False)),
]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.reordered
@pytest.mark.parametrize("arch,kw", CONFIGS)
def test_logits_match_transformers(tmp_path, arch, kw):
    ref = hf_checkpoint(str(tmp_path), arch, **kw)
    ours = load_model(str(tmp_path))
    x = torch.randint(0, 512, (3, 23))
    with torch.no_grad():
        assert rel_err(ours(x), ref(x).logits) < 1e-5


@pytest.mark.reordered
@pytest.mark.parametrize("model", ["qwen2", "llama3", "qwen3"])
def test_padded_batch_matches_transformers(tiny_hf, tmp_path, model):
    """Left-padded prompts (the training and generation layout) against HF's attention_mask."""
    path, ref = tiny_hf
    if model == "llama3":
        path, ref = str(tmp_path), hf_checkpoint(str(tmp_path), "llama", rope_parameters=LLAMA3)
    if model == "qwen3":
        path, ref = str(tmp_path), hf_checkpoint(str(tmp_path), "qwen3")
    ours = load_model(path)
    x = torch.randint(0, 512, (3, 12))
    valid = torch.ones(3, 12, dtype=torch.bool)
    valid[1, :5] = False
    valid[2, :2] = False
    with torch.no_grad():
        got = ours(x, positions_from(valid), attention_mask(valid))
        want = ref(x, attention_mask=valid.long(), position_ids=positions_from(valid)).logits
    assert rel_err(got[valid], want[valid]) < 1e-5


def test_save_load_roundtrip_bit_exact(tmp_path):
    cfg = ModelConfig(tie_word_embeddings=False, num_hidden_layers=2, vocab_size=300)
    model = build(cfg)
    model.init_weights(seed=3)
    save_model(model, cfg, str(tmp_path))
    again = load_model(str(tmp_path))
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert dataclasses.replace(read_config(str(tmp_path)), extra={}) == cfg


@pytest.mark.parametrize("arch,llama3", [("Qwen2ForCausalLM", False), ("LlamaForCausalLM", False),
                                         ("LlamaForCausalLM", True), ("Qwen3ForCausalLM", False)])
def test_our_checkpoint_loads_in_transformers(tmp_path, arch, llama3):
    import transformers

    from models.decoder import LLAMA3_ROPE

    cfg = ModelConfig(architecture=arch, attention_bias=arch.startswith("Qwen2"), num_hidden_layers=2,
                      tie_word_embeddings=arch.startswith("Qwen2"), rope_theta=20000.0,
                      rope_llama3={k: LLAMA3[k] for k in LLAMA3_ROPE} if llama3 else None)
    model = build(cfg)
    model.init_weights(seed=1)
    save_model(model, cfg, str(tmp_path))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(ref).__name__ == arch
    x = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        assert rel_err(model(x), ref(x).logits) < 1e-5


@pytest.mark.reordered
def test_sharded_checkpoint_loads(tmp_path):
    ref = hf_checkpoint(str(tmp_path), "qwen2", tie_word_embeddings=False)
    ref.save_pretrained(str(tmp_path), max_shard_size="200KB")
    if os.path.exists(tmp_path / "model.safetensors"):
        os.remove(os.path.join(tmp_path, "model.safetensors"))
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    names = {n for n, _ in iter_checkpoint(str(tmp_path))}
    assert "lm_head.weight" in names
    ours = load_model(str(tmp_path))
    x = torch.randint(0, 512, (2, 7))
    with torch.no_grad():
        assert rel_err(ours(x), ref(x).logits) < 1e-5


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_config(str(tmp_path))


def test_config_without_a_needed_key_is_a_clear_error(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64}, f)
    with pytest.raises(ValueError, match="has no 'num_attention_heads'"):
        read_config(str(tmp_path))


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, f)
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        read_config(str(tmp_path))


def test_wrong_shape_checkpoint_is_a_clear_error(tmp_path):
    hf_checkpoint(str(tmp_path), "qwen2")
    cfg = read_config(str(tmp_path))
    cfg.intermediate_size = 128
    from models.hf import load_state
    with pytest.raises(ValueError, match="shape mismatch for model.layers.0.mlp"):
        load_state(build(cfg), iter_checkpoint(str(tmp_path)))


def test_llama3_rope_frequencies_equal_a_loop_over_dimensions():
    """models.decoder.rope_frequencies against Llama 3.1's rule written per frequency."""
    import math

    from models.decoder import rope_frequencies

    scaling = {k: LLAMA3[k] for k in LLAMA3 if k not in ("rope_type", "rope_theta")}
    got = rope_frequencies(32, 10000.0, scaling)
    bands = set()
    for i in range(16):
        inv = 1.0 / 10000.0 ** (2 * i / 32)
        wavelen = 2 * math.pi / inv
        if wavelen < 64 / 4:  # shorter than original / high_freq_factor: kept
            want, band = inv, "kept"
        elif wavelen > 64 / 1:  # longer than original / low_freq_factor: stretched by the factor
            want, band = inv / 8, "stretched"
        else:
            smooth = (64 / wavelen - 1) / (4 - 1)
            want, band = (1 - smooth) * inv / 8 + smooth * inv, "between"
        bands.add(band)
        assert abs(got[i].item() - want) <= 1e-6 * want
    assert bands == {"kept", "between", "stretched"}


@pytest.mark.parametrize("rope,says", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_type 'yarn'"),
    ({"rope_type": "llama3", "factor": 8.0}, "without ['low_freq_factor'"),
])
def test_an_unsupported_rope_is_refused_naming_the_key(tmp_path, rope, says):
    hf_checkpoint(str(tmp_path), "llama")
    with open(tmp_path / "config.json") as f:
        d = json.load(f)
    d["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(ValueError, match=re.escape(says)):
        read_config(str(tmp_path))


def test_a_hub_id_resolves_to_its_cached_snapshot(tmp_path, monkeypatch):
    """--model ORG/NAME: huggingface_hub's snapshot, here from a cache laid out as the hub lays it out
    (offline: no test uses the network); a local path stays as it is."""
    import shutil

    import huggingface_hub.constants

    from models.hf import local_dir

    snapshot = tmp_path / "models--test--tiny" / "snapshots" / "abc123"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "assets", "arith-tiny"), snapshot)
    (tmp_path / "models--test--tiny" / "refs").mkdir()
    (tmp_path / "models--test--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    path = local_dir("test/tiny")
    assert os.path.samefile(path, snapshot)
    assert read_config(path).architecture == "Qwen2ForCausalLM"
    assert local_dir("assets/arith-tiny") == "assets/arith-tiny"


def tied_tiny_lm():
    """A 2-layer model of 64 tokens with a tied head, seed 0 (the head-chunk and padding tests)."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    model = build(cfg)
    model.init_weights(seed=0)
    return model


@pytest.mark.reordered
def test_completion_logprobs_in_head_chunks_train_as_the_whole_batch(monkeypatch):
    """models.decoder.completion_logprobs through the model: with a logits budget of two rows the head
    runs in chunks (models.decoder.head_logprobs), and the log-probs and every parameter's gradient
    (tied head and embeddings included) agree with the one-chunk run to fp32 rounding."""
    from models import decoder
    from models.decoder import completion_logprobs
    from tasks.data import make_batch

    model = tied_tiny_lm()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 5, 4, 2, 5)]
    tokens = torch.randint(1, 64, (5, 6), generator=g)
    batch = make_batch(prompts, tokens, torch.tensor([6, 2, 4, 6, 1]), 0)

    def run():
        model.zero_grad()
        logp = completion_logprobs(model, batch, 0.8)  # [5, 6]
        (logp * batch["loss_mask"]).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    chunks = []
    apply = decoder._HeadLogprobs.apply
    monkeypatch.setattr(decoder._HeadLogprobs, "apply", lambda *a: chunks.append(a[-1]) or apply(*a))
    whole, whole_grads = run()
    # two rows of 7 logits: 6, the prompt's last
    monkeypatch.setattr(decoder, "LOGITS_BUDGET", 2 * 7 * 64 * 4)
    chunked, chunked_grads = run()
    assert chunks == [2]  # the second run only, in chunks of two rows
    assert torch.allclose(chunked, whole, atol=1e-5)
    assert_same_by_norm(chunked_grads, whole_grads)  # the head's matmul over other rows: reordered sums


@pytest.mark.reordered
def test_micro_batches_without_padding_columns_give_the_whole_batchs_logprobs_and_gradient():
    """tasks.data.forward_batches: rows sorted by completion length into micro-batches of 2, each
    cut to the columns its own rows use (prompts' left padding, completions' right padding). The
    log-probs put back by scatter_rows and the summed gradient equal the whole batch's, to fp32
    rounding (the same math; the cut columns were masked keys and padded queries, which add exact
    zeros, but the sums run over other widths, so they may round differently: 1e-5 relative)."""
    from models.decoder import completion_logprobs
    from tasks.data import forward_batches, make_batch, scatter_rows

    model = tied_tiny_lm()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 7, 4, 2, 5)]
    tokens = torch.randint(1, 64, (5, 8), generator=g)
    lengths = torch.tensor([8, 2, 5, 1, 3])
    batch = make_batch(prompts, tokens, lengths, 0)
    batch["adv"] = torch.randn(5, 1, generator=g).expand(5, 8)  # [N, T], cut like the log-probs

    def grads():
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    whole = completion_logprobs(model, batch, 0.8)  # [5, 8]
    (whole * batch["adv"] * batch["loss_mask"]).sum().backward()
    whole_grads = grads()

    model.zero_grad()
    parts, widths = [], []
    for rows, mb in forward_batches(batch, 2):
        logp = completion_logprobs(model, mb, 0.8)  # [n, T']
        assert logp.shape == mb["loss_mask"].shape == mb["adv"].shape
        (logp * mb["adv"] * mb["loss_mask"]).sum().backward()
        parts.append((rows, logp.detach()))
        widths.append((rows.tolist(), mb["input_ids"].shape[1], mb["prompt_len"]))
    # longest completions first, each micro-batch as wide as its own rows need
    assert widths == [([0, 2], 4 + 8, 4), ([4, 1], 7 + 3, 7), ([3], 2 + 1, 2)]  # (rows, P' + T', P')
    cut = scatter_rows(parts, 5, 8)
    mask = batch["loss_mask"] > 0
    assert torch.allclose(cut[mask], whole.detach()[mask], rtol=1e-5, atol=1e-6)
    assert (cut[3, 1:] == 0).all() and (cut[4, 3:] == 0).all()  # cut off: 0
    assert_same_by_norm(grads(), whole_grads)  # each parameter's gradient, relative to its norm
    # one micro-batch: the batch as it is (the engine's T is already its longest completion)
    (rows, mb), = forward_batches(batch, 5)
    assert rows.tolist() == [0, 1, 2, 3, 4] and mb["input_ids"].shape == batch["input_ids"].shape
