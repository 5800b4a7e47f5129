"""The reward model: our scores against transformers' ...ForSequenceClassification, the role's
checks, the Bradley-Terry loss, and train_rm.py end to end under torchrun (2 ranks, gloo)."""
import json
import math
import os
import random
import re

import pytest
import torch
from conftest import hf_checkpoint
from test_fsdp import torchrun

from assets.make import make_tokenizer
from models.decoder import positions_from, sequence_scores
from models.hf import load_model
from models.tokenizer import Tokenizer, train_tokenizer
from rl.algos import bradley_terry_loss
from roles import reward_model
from tasks.data import arith_rows, load_pairs, make_batch, take_rows, tokenize_pairs
from utils.errors import UserError

POLICY = "assets/arith-tiny"


def hf_reward_model(path, arch="qwen2", seed=0, num_labels=1, **kw):
    """A random transformers ...ForSequenceClassification saved in HF format with the built-in
    task's tokenizer, pad_token_id its pad (= EOS) id; norms, biases and the score head random."""
    import transformers

    pad = make_tokenizer(path)
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=512, eos_token_id=pad, pad_token_id=pad,
                num_labels=num_labels)
    base.update(kw)
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = transformers.Qwen2ForSequenceClassification(transformers.Qwen2Config(**base))
    elif arch == "qwen3":
        model = transformers.Qwen3ForSequenceClassification(transformers.Qwen3Config(**base))
    else:
        model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**base))
    with torch.no_grad():  # HF starts norms at 1, biases at 0 and the head near 0
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif name == "score.weight":
                p.normal_(0.0, 1.0)
    model.eval().save_pretrained(path)
    return model


def padded_batch(pad: int, eos_last: bool = False):
    """make_batch's layout: left-padded prompts, right-padded completions, one empty. Real tokens
    are never the pad id (HF finds the last real token by input_ids != pad_token_id), except the
    completions' last token with eos_last (an EOS that is also the pad token)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (3, 6, 1, 4)]
    lengths = torch.tensor([4, 1, 3, 0])
    tokens = torch.randint(1, 512, (4, 5), generator=g)  # [N, T]
    if eos_last:
        tokens[torch.arange(3), lengths[:3] - 1] = pad
    return make_batch(prompts, tokens, lengths, pad)


def hf_scores(ref, batch):
    valid = batch["valid"]
    with torch.no_grad():
        out = ref(batch["input_ids"], attention_mask=valid.long(), position_ids=positions_from(valid))
    return out.logits[:, 0]  # [N]


LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.reordered
@pytest.mark.parametrize("arch,kw", [("qwen2", {}),
                                     ("llama", {"num_key_value_heads": 1, "attention_bias": True}),
                                     ("llama", {"rope_parameters": LLAMA3}),
                                     ("qwen3", {})])
def test_scores_match_transformers(tmp_path, arch, kw):
    ref = hf_reward_model(str(tmp_path), arch, **kw)
    ours = load_model(str(tmp_path))
    assert type(ours.score).__name__ == "Linear" and not hasattr(ours, "lm_head")
    for eos_last in (False, True):  # an EOS equal to the pad id is skipped by both
        batch = padded_batch(ref.config.pad_token_id, eos_last)
        with torch.no_grad():
            got = sequence_scores(ours, batch)  # [N]
        want = hf_scores(ref, batch)
        assert want.abs().min() > 0.1  # the head is not near zero: the test sees it
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (eos_last, got, want)


@pytest.mark.reordered
def test_sharded_reward_model_matches_transformers(tmp_path):
    """The role, FSDP2 over 2 ranks with micro-batches of one row (tasks.data.forward_batches: the
    rows longest completion first, each cut to its own columns), on an EOS-terminated batch."""
    path = str(tmp_path / "rm")
    ref = hf_reward_model(path, "llama", seed=1, tie_word_embeddings=False)
    # completions 1, 4 | 0, 3 tokens long: each rank's rows shortest first, so the sort reorders them
    batch = take_rows(padded_batch(ref.config.pad_token_id, eos_last=True), torch.tensor([1, 0, 3, 2]))
    torch.save(batch, tmp_path / "batch.pt")
    torchrun(2, "tests/helpers/rm_scores.py", path, path, str(tmp_path / "batch.pt"), str(tmp_path / "s"))
    got = torch.cat([torch.load(tmp_path / f"s.rank{r}.pt") for r in range(2)])
    assert torch.allclose(got, hf_scores(ref, batch), rtol=1e-5, atol=1e-5)


def test_check_says_what_is_wrong(tmp_path):
    good, policy = str(tmp_path / "good"), str(tmp_path / "policy")
    hf_reward_model(good)
    hf_checkpoint(policy)
    reward_model.check(good, policy)  # the same tokenizer: fine

    no_pad = str(tmp_path / "no_pad")
    hf_reward_model(no_pad)
    with open(os.path.join(no_pad, "config.json")) as f:
        config = json.load(f)
    del config["pad_token_id"]
    with open(os.path.join(no_pad, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(UserError, match="config.json has no pad_token_id"):
        reward_model.check(no_pad, policy)

    with pytest.raises(UserError, match="is a Qwen2ForCausalLM: use a ...ForSequenceClassification"):
        reward_model.check(policy, policy)

    two = str(tmp_path / "two")
    hf_reward_model(two, num_labels=2)
    with pytest.raises(UserError, match="has 2 labels"):
        reward_model.check(two, policy)

    other = str(tmp_path / "other")
    hf_reward_model(other)
    train_tokenizer(["another corpus, other merges"] * 10, other)
    with pytest.raises(UserError, match="has another tokenizer than --model"):
        reward_model.check(other, policy)

    with pytest.raises(UserError, match="does not exist"):
        reward_model.check(str(tmp_path / "nowhere"), policy)


def test_bradley_terry_loss_by_hand():
    chosen = torch.tensor([2.0, 0.0, -1.0, 100.0, -100.0])
    rejected = torch.tensor([0.0, 0.0, 1.0, -100.0, 100.0])
    # -log sigmoid(d) = log(1 + e^-d): d = 2, 0, -2, 200, -200
    want = torch.tensor([math.log(1 + math.exp(-2)),  # 0.126928
                         math.log(2.0),  # 0.693147
                         math.log(1 + math.exp(2)),  # 2.126928
                         0.0,  # e^-200 underflows: no NaN
                         200.0])  # log(1 + e^200) = 200 + log(1 + e^-200)
    assert torch.allclose(bradley_terry_loss(chosen, rejected), want, rtol=1e-6, atol=1e-6)
    assert abs(want[0].item() - 0.126928) < 1e-6 and abs(want[2].item() - 2.126928) < 1e-6


def test_pairs_from_a_file_and_their_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"q": "1+2=", "good": "3", "bad": "4"}) + "\n")
    pairs = load_pairs(str(f), "train", "good", "bad", "q")
    assert pairs == [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}]
    tok = Tokenizer(POLICY)
    (pair,), skipped = tokenize_pairs(pairs, tok, 64)
    assert skipped == 0 and pair["chosen_ids"] == tok.encode("3", False) + [0]  # the answer, then EOS
    with pytest.raises(UserError, match="no rejected column 'rejected'.*pass --rejected-column"):
        load_pairs(str(f), "train", "good", "rejected", "q")
    with pytest.raises(UserError, match="no prompt column 'prompt'"):
        load_pairs(str(f), "train", "good", "bad", "prompt")
    with pytest.raises(UserError, match="every pair is longer than --max-tokens=3"):
        tokenize_pairs(pairs, tok, 3)
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(UserError, match="is empty"):
        load_pairs(str(tmp_path / "e.jsonl"), "train", "good", "bad", None)
    (tmp_path / "n.jsonl").write_text(json.dumps({"good": "3", "bad": 4}) + "\n")
    with pytest.raises(UserError, match="column 'bad' must be a non-empty string"):
        load_pairs(str(tmp_path / "n.jsonl"), "train", "good", "bad", None)


def write_pairs(path, split, n, seed):
    """The built-in problems as a preference file: the right sum beats a random other number."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for r in arith_rows(split)[:n]:
            wrong = r["answer"]
            while wrong == r["answer"]:
                wrong = str(rng.randrange(200))
            f.write(json.dumps({"question": r["prompt"], "good": r["answer"], "bad": wrong}) + "\n")


def test_train_rm_learns_and_writes_a_transformers_reward_model(tmp_path):
    import transformers

    train, held_out, out = str(tmp_path / "train.jsonl"), str(tmp_path / "eval.jsonl"), str(tmp_path / "rm")
    write_pairs(train, "train", 400, seed=0)
    write_pairs(held_out, "eval", 64, seed=1)
    p = torchrun(2, "train_rm.py", "--dataset", train, "--eval-dataset", held_out, "--prompt-column",
                 "question", "--chosen-column", "good", "--rejected-column", "bad", "--steps", "20",
                 "--batch-size", "32", "--warmup-steps", "2", "--eval-every", "10", "--log-every", "5",
                 "--out", out, timeout=120)
    acc = [float(a) for a in re.findall(r"eval/pair_acc (\S+)", p.stdout)]
    assert len(acc) == 3 and acc[0] == 0.5  # the zero head ties every pair
    assert acc[-1] > 0.7, p.stdout  # measured: 0.500 -> 0.812 (step 10) -> 0.844
    assert "train/loss" in p.stdout

    reward_model.check(out, POLICY)
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert type(ref).__name__ == "Qwen2ForSequenceClassification" and ref.config.num_labels == 1
    tok = Tokenizer(out)
    pairs, _ = tokenize_pairs(load_pairs(held_out, "test", "good", "bad", "question")[:4], tok, 64)
    prompts = [q["ids"] for q in pairs] * 2
    answers = [q["chosen_ids"] for q in pairs] + [q["rejected_ids"] for q in pairs]  # each ends with EOS
    T = max(map(len, answers))
    tokens = torch.tensor([a + [tok.pad_id] * (T - len(a)) for a in answers])
    batch = make_batch(prompts, tokens, torch.tensor([len(a) for a in answers]), tok.pad_id)
    with torch.no_grad():
        ours = sequence_scores(load_model(out), batch)
    assert torch.allclose(ours, hf_scores(ref, batch), rtol=1e-5, atol=1e-5)


def test_train_rm_batch_that_does_not_split_is_one_error_line(tmp_path):
    p = torchrun(2, "train_rm.py", "--batch-size", "3", "--out", str(tmp_path / "rm"), timeout=60,
                 check=False)
    assert p.returncode != 0
    assert "error: --batch-size 3: use a multiple of the 2 ranks, such as [16, 32, 64]" in p.stderr
    assert "[rank0]: Traceback" not in p.stderr  # (torchrun's own report of the failed worker follows)
