"""The native engine against transformers: greedy tokens, sampled log-probs, sampler law."""
import dataclasses

import pytest
import torch
from conftest import hf_checkpoint

from engines.decode import SamplingParams, inverse_cdf, sample_tokens, uniforms
from engines.native import NativeEngine
from models.hf import iter_checkpoint, read_config
from models.tokenizer import Tokenizer
from tasks.data import arith_rows


def engine_for(path):
    eng = NativeEngine(read_config(path), Tokenizer(path))
    eng.load_weights(iter_checkpoint(path))
    return eng


def prompts(tok, k=6):
    ps = [tok.encode(r["prompt"]) for r in arith_rows("eval")[:k]]
    if k > 1:
        ps[1] = ps[1][:2]  # different lengths: left padding must not change anything
    return ps


@pytest.fixture(scope="module", params=["qwen2", "llama", "llama3", "qwen3"])
def decode_model(request, tiny_hf, tmp_path_factory):
    """(path, transformers model): the untied Qwen2 (q/k/v bias), a tied Llama with o_proj bias, a
    Llama with Llama 3.1's RoPE scaling (tests/test_model.py LLAMA3) and a Qwen3 (per-head q/k norm)."""
    if request.param == "qwen2":
        return tiny_hf
    path = str(tmp_path_factory.mktemp("tiny-" + request.param))
    if request.param == "llama3":
        from test_model import LLAMA3

        return path, hf_checkpoint(path, arch="llama", rope_parameters=LLAMA3)
    if request.param == "qwen3":
        return path, hf_checkpoint(path, arch="qwen3")
    return path, hf_checkpoint(path, arch="llama", attention_bias=True, tie_word_embeddings=True)


@pytest.fixture(params=["onednn", "plain"])
def decode_weights(request, monkeypatch):
    """Both decode paths: oneDNN-packed weights (CPU fp32) and the model's own (GPU, bf16)."""
    if request.param == "plain":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    elif not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    return request.param


@pytest.mark.reordered
def test_greedy_equals_transformers_generate(decode_model, decode_weights):
    path, ref = decode_model
    eng = engine_for(path)
    eng.generate([[1, 2]], SamplingParams(max_new_tokens=2), [0])  # prepares the decode weights
    assert eng.decoder.step_head[1].is_mkldnn == (decode_weights == "onednn")
    ps = prompts(eng.tok)
    out = eng.generate(ps, SamplingParams(temperature=0, max_new_tokens=24), seeds=list(range(len(ps))))
    eos = min(eng.tok.eos_ids)
    for i, p in enumerate(ps):
        want = ref.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=eos,
                            pad_token_id=eos)[0, len(p):].tolist()
        assert out.tokens[i, :out.lengths[i]].tolist() == want
        assert out.finish_reasons[i] == ("stop" if want[-1] == eos else "length")


@pytest.mark.reordered
def test_the_static_step_of_the_cuda_graph_generates_what_the_eager_step_does(decode_model, decode_weights):
    """GraphedStep's step (engines/decode.py: each token written at a slot held in a tensor, attention
    over the whole cache with the unwritten slots masked), run eagerly on this CPU, against the
    eager step over the written slots only. The masked slots add exact zeros, but a longer row may
    be summed in another order, so the log-probs may differ in their last bits: 1e-5 is ~100x
    fp32's rounding at their size; greedy tokens then agree unless two logits tie within it."""
    path, _ = decode_model
    eager, static = engine_for(path), engine_for(path)
    static.graphs = ("cpu",)
    ps = prompts(eager.tok)
    sp = SamplingParams(temperature=0, max_new_tokens=16)
    a, b = eager.generate(ps, sp, list(range(len(ps)))), static.generate(ps, sp, list(range(len(ps))))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
    assert (a.logprobs - b.logprobs).abs().max() < 1e-5


@pytest.mark.reordered
def test_a_groups_prompt_is_prefilled_once_and_samples_as_if_each_had_its_own(decode_model, monkeypatch):
    """NativeEngine._prefill: n = 4 samples of each prompt run the prefill over the distinct prompts
    only (6 rows, not 24), their keys and values copied to the 4 rows; at temperature 0 every sample
    is what the same prompt, given 4 times and prefilled 4 times, gives: the same tokens, log-probs
    within 1e-5 (the same math on another batch size may round otherwise)."""
    path, _ = decode_model
    eng = engine_for(path)
    ps = prompts(eng.tok)
    rows, call = [], type(eng.decoder).__call__  # the rows of each prefill

    def counted(self, tokens, *args, **kw):
        rows.append(len(tokens))
        return call(self, tokens, *args, **kw)
    monkeypatch.setattr(type(eng.decoder), "__call__", counted)
    sp = SamplingParams(n=4, temperature=0, max_new_tokens=12)
    grouped = eng.generate(ps, sp, list(range(6)))
    each = eng.generate([p for p in ps for _ in range(4)], dataclasses.replace(sp, n=1),
                        [i for i in range(6) for _ in range(4)])
    assert rows == [6, 24]  # the prefills: once per prompt, then once per copy
    assert torch.equal(grouped.tokens, each.tokens) and torch.equal(grouped.lengths, each.lengths)
    assert (grouped.logprobs - each.logprobs).abs().max() < 1e-5


@pytest.mark.reordered
def test_finished_rows_leave_the_batch_and_the_others_generate_as_if_they_stayed(decode_model,
                                                                                 decode_weights):
    """Once half the batch has finished, the eager step sheds finished rows (rows, their cache,
    mask and positions), down to a power of two. Every third token made an end of sequence, so
    rows end at many different steps; against the static step (a CUDA graph's fixed shapes, run
    eagerly here), which keeps every row to the end: the same tokens and lengths, log-probs
    within 1e-5 (the same math on fewer rows, as above)."""
    path, _ = decode_model
    shed, whole = engine_for(path), engine_for(path)
    whole.graphs = ("cpu",)
    for e in (shed, whole):
        e.eos = torch.arange(0, e.cfg.vocab_size, 3)
    sizes, decode = [], shed.decoder.decode  # the batch of each decode step
    shed.decoder.decode = lambda tokens, *a: sizes.append(len(tokens)) or decode(tokens, *a)
    ps = prompts(shed.tok)
    sp = SamplingParams(n=4, temperature=1.0, max_new_tokens=16)
    a, b = shed.generate(ps, sp, list(range(6))), whole.generate(ps, sp, list(range(6)))
    assert sizes[0] == 24 and min(sizes) < 12, sizes  # it shed, at least once
    assert all(n & (n - 1) == 0 for n in sizes if n != 24), sizes
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
    assert (a.logprobs - b.logprobs).abs().max() < 1e-5


@pytest.mark.reordered
def test_a_request_that_extends_the_last_ones_rows_prefills_only_what_is_new(decode_model, decode_weights,
                                                                            monkeypatch):
    """keep_prefixes (multi-turn episodes): a second request whose prompts extend the first's rows
    (each row's prompt and completion, then 1-4 tokens of a reply) takes their kept keys and
    values and prefills only the new columns, and samples what an engine prefilling every prompt
    whole samples. A brand-new prompt in the same request is prefilled whole. The kept keys and
    values were made by the decode step, the whole prefill's by the prefill: the same math summed
    in another order, so the log-probs agree to 1e-5 (as for the static step above), the tokens
    exactly unless two probabilities tie within it."""
    from engines.decode import KeptPrefixes

    path, _ = decode_model
    kept, whole = engine_for(path), engine_for(path)
    kept.keep_prefixes = True
    for e in (kept, whole):  # every fourth token ends a row: rows end apart, and the batch sheds them
        e.eos = torch.arange(0, e.cfg.vocab_size, 4)
    ps = prompts(kept.tok, 4)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)
    first = kept.generate(ps, sp, [5, 6, 7, 8])
    reply = kept.tok.encode(" and 12 more")
    nxt = [ps[r // 2] + first.tokens[r, :first.lengths[r]].tolist() + reply[:1 + r % 4] for r in range(8)]
    nxt.insert(3, ps[1][:2])  # a prompt that extends no row
    filled, fill = [], KeptPrefixes.fill  # the columns each request left to prefill
    monkeypatch.setattr(KeptPrefixes, "fill", lambda self, *a: filled.append(fill(self, *a)) or filled[-1])
    sp = SamplingParams(n=1, temperature=1.0, max_new_tokens=8)
    a, b = kept.generate(nxt, sp, list(range(9))), whole.generate(nxt, sp, list(range(9)))
    assert filled == [5]  # the longest reply and the model's last token; the new prompt's 2 tokens fit in it
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
    assert (a.logprobs - b.logprobs).abs().max() < 1e-5
    assert kept.kept is not None and whole.kept is None  # and a weight load drops it (the old weights')
    kept.load_weights(iter_checkpoint(path))
    assert kept.kept is None


@pytest.mark.reordered
@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 20)])
def test_sampled_logprobs_equal_full_forward(decode_model, temperature, top_p, top_k, decode_weights):
    path, ref = decode_model
    eng = engine_for(path)
    ps = prompts(eng.tok, 3)
    sp = SamplingParams(n=4, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=16)
    out = eng.generate(ps, sp, seeds=[11, 12, 13])
    for row in range(len(ps) * sp.n):
        p, n = ps[row // sp.n], int(out.lengths[row])
        seq = torch.tensor([p + out.tokens[row, :n].tolist()])
        with torch.no_grad():
            logits = ref(seq).logits[0, len(p) - 1:-1] / temperature  # [n, V]
        want = torch.log_softmax(logits, -1).gather(-1, out.tokens[row, :n, None])[:, 0]
        assert torch.allclose(out.logprobs[row, :n], want, atol=1e-5, rtol=0)
        if top_k:  # every sampled token lies inside the top-k set
            ranks = (logits > logits.gather(-1, out.tokens[row, :n, None])).sum(-1)
            assert (ranks < top_k).all()


def test_samples_depend_on_the_prompt_seed_only(tiny_hf):
    """The same (prompt, seed) gives the same samples whatever else is in the batch."""
    path, _ = tiny_hf
    eng = engine_for(path)
    ps = prompts(eng.tok, 4)
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=12)
    together = eng.generate(ps, sp, seeds=[5, 6, 7, 8])
    alone = eng.generate(ps[2:3], sp, seeds=[7])
    assert torch.equal(together.tokens[6:9, :alone.tokens.shape[1]], alone.tokens)
    other_seed = eng.generate(ps[2:3], sp, seeds=[70])
    assert not torch.equal(other_seed.tokens, alone.tokens)


def test_sampler_follows_the_distribution():
    """Inverse-CDF sampling with hashed uniforms: frequencies match softmax, top-k/top-p cut."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]).repeat(20000, 1)
    keys = torch.arange(20000)
    tok, lp = sample_tokens(logits, SamplingParams(temperature=1.0), uniforms(keys, 3))
    freq = torch.bincount(tok, minlength=5).float() / len(tok)
    p = torch.softmax(logits[0], -1)
    assert (freq - p).abs().max() < 0.012  # ~4 standard errors at n=20000
    assert torch.allclose(lp, p.log()[tok])
    tok, _ = sample_tokens(logits, SamplingParams(temperature=1.0, top_k=2), uniforms(keys, 3))
    f2 = torch.bincount(tok, minlength=5).float() / len(tok)
    assert f2[2:].sum() == 0 and abs(f2[0] - p[0] / p[:2].sum()) < 0.012
    tok, _ = sample_tokens(logits, SamplingParams(temperature=1.0, top_p=0.5), uniforms(keys, 3))
    assert (tok == 0).all()  # p[0] = 0.57 >= 0.5: the nucleus is one token


def sort_sampler(logits, params, u):
    """The plain definition: sort the whole vocabulary, cut top-k and top-p, inverse CDF (the
    same `inverse_cdf`: it has its own test)."""
    logp = torch.log_softmax(logits / params.temperature, -1)
    probs, order = logp.exp().sort(-1, descending=True)
    if params.top_k > 0:
        probs[:, params.top_k:] = 0
    if params.top_p < 1.0:
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= params.top_p, 0)
    tok = order.gather(-1, inverse_cdf(probs, u))[:, 0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


@pytest.mark.parametrize("V", [1000, 150_000])
def test_inverse_cdf_draws_from_the_running_sum(V):
    """Each draw i satisfies cdf[i-1] < u * total <= cdf[i] for the float64 running sum over the
    whole row (up to 1e-6 relative: the large-vocabulary path sums blocks in fp32), never lands on
    a zero entry, and nearly always equals searchsorted on that cumsum."""
    g = torch.Generator().manual_seed(V)
    probs = torch.softmax(torch.randn(32, V, generator=g) * 3, -1)
    probs[:, ::7] = 0  # zeros inside the row, as top-p leaves them
    probs[:, -50:] = 0  # and at its end
    cdf = probs.double().cumsum(-1)  # [N, V]
    same = 0
    # the largest uniform: the last nonzero entry
    top = torch.full((32,), 1 - 2.0 ** -33, dtype=torch.float64)
    for u in [uniforms(torch.arange(32), t) for t in range(20)] + [top]:
        target = u * cdf[:, -1]  # [N]
        i = inverse_cdf(probs, u)  # [N, 1]
        below = torch.where(i > 0, cdf.gather(-1, (i - 1).clamp(min=0)), 0.0)[:, 0]
        assert (below < target * (1 + 1e-6)).all() and (cdf.gather(-1, i)[:, 0] >= target * (1 - 1e-6)).all()
        assert (probs.gather(-1, i) > 0).all()
        same += int((i[:, 0] == torch.searchsorted(cdf, target[:, None])[:, 0]).sum())
    assert same >= 0.99 * 32 * 21


@pytest.mark.parametrize("rows", ["peaked", "flat", "mixed"])
@pytest.mark.parametrize("top_p,top_k", [(0.9, 0), (1.0, 40), (0.8, 300)])
def test_candidate_sampler_equals_sorting_the_vocabulary(rows, top_p, top_k):
    """top-k / top-p look at the top candidates and sort the whole vocabulary only for rows whose
    candidates hold too little mass (flat rows): the same tokens as sorting everything."""
    g = torch.Generator().manual_seed(0)
    V, N = 5000, 64  # more than the 1024 candidates top-p tries first
    flat = torch.randn(N, V, generator=g) * 0.5  # the top 1024 hold about a third of the mass
    peaked = flat.clone()
    peaked[:, :30] += 12  # nearly all the mass on 30 tokens
    mixed = torch.where(torch.arange(N)[:, None] % 4 == 0, flat, peaked)  # a quarter of the rows flat
    logits = {"peaked": peaked, "flat": flat, "mixed": mixed}[rows]
    sp, u = SamplingParams(temperature=0.9, top_p=top_p, top_k=top_k), uniforms(torch.arange(N), 7)
    p = torch.softmax(logits / 0.9, -1).topk(1024, -1).values.sum(-1)  # [N]
    assert {"peaked": (p > 0.99).all(), "flat": (p < 0.5).all(), "mixed": (p < 0.5).sum() == N // 4}[rows]
    tok, lp = sample_tokens(logits, sp, u)
    want_tok, want_lp = sort_sampler(logits, sp, u)
    assert torch.equal(tok, want_tok) and torch.equal(lp, want_lp)


def test_stop_string_ends_the_completion(tiny_hf):
    path, _ = tiny_hf
    eng = engine_for(path)
    ps = prompts(eng.tok, 1)
    free = eng.generate(ps, SamplingParams(temperature=0, max_new_tokens=12), seeds=[0])
    text3 = eng.tok.decode(free.tokens[0, :3].tolist())
    stop = text3[-1]  # a character the completion reaches by its third token
    out = eng.generate(ps, SamplingParams(temperature=0, max_new_tokens=12, stop=[stop]), seeds=[0])
    n = int(out.lengths[0])
    assert n <= 3 and out.finish_reasons == ["stop"]
    assert stop in eng.tok.decode(out.tokens[0, :n].tolist())
    assert stop not in out.texts[0]


def test_load_weights_replaces_the_model(tiny_hf, tmp_path):
    from conftest import hf_checkpoint

    path, _ = tiny_hf
    eng = engine_for(path)
    ps = prompts(eng.tok, 3)
    sp = SamplingParams(temperature=0, max_new_tokens=10)
    before = eng.generate(ps, sp, seeds=[0, 1, 2])
    other = hf_checkpoint(str(tmp_path), seed=9)
    eng.load_weights(iter_checkpoint(str(tmp_path)))
    after = eng.generate(ps, sp, seeds=[0, 1, 2])
    assert not torch.equal(before.tokens, after.tokens)
    eos = min(eng.tok.eos_ids)
    for i, p in enumerate(ps):
        want = other.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos)[0, len(p):].tolist()
        assert after.tokens[i, :after.lengths[i]].tolist() == want


@pytest.mark.reordered
def test_bf16_engine_runs_and_agrees_with_fp32_log_probs(tiny_hf):
    """The bf16 path (GPU default): RoPE tables must follow the weights' dtype."""
    path, ref = tiny_hf
    fp32 = engine_for(path)
    bf16 = NativeEngine(read_config(path), Tokenizer(path), dtype=torch.bfloat16)
    bf16.load_weights(iter_checkpoint(path))
    ps = prompts(fp32.tok, 4)
    sp = SamplingParams(temperature=0, max_new_tokens=6)
    a, b = fp32.generate(ps, sp, [0, 1, 2, 3]), bf16.generate(ps, sp, [0, 1, 2, 3])
    assert torch.isfinite(b.logprobs).all()
    assert torch.equal(a.tokens[:, 0], b.tokens[:, 0])  # the first greedy token survives bf16 rounding
    assert (a.logprobs[:, 0] - b.logprobs[:, 0]).abs().max() < 0.05
    for i, p in enumerate(ps):  # every decode step too: bf16's log-probs of its own tokens vs an fp32 forward
        n = int(b.lengths[i])
        with torch.no_grad():
            logits = ref(torch.tensor([p + b.tokens[i, :n].tolist()])).logits[0, len(p) - 1:-1]  # [n, V]
        want = torch.log_softmax(logits, -1).gather(-1, b.tokens[i, :n, None])[:, 0]
        assert (b.logprobs[i, :n] - want).abs().max() < 0.1, (b.logprobs[i, :n], want)
