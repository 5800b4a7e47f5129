"""Run by tests/test_stream.py in its own process (vLLM binds threads and builds groups): --stream's
vLLM pool (engines/vllm_pool.py) with an update in flight. Prints JSON on its last line.

  MODEL keep|drop   an engine in this process; 2 prompts x 2 samples run 20 engine steps under version
                    0, then version 1 goes in (keep: the samples go on under it; drop: they start over)
                    and a held-out evaluation of 2 prompts runs between the stream's steps; every token's
                    log-prob is set beside the trainer's model's under the version vLLM says sampled it;
                    then a seeded batch of more prompt tokens than vLLM's default step budget;
                    drop also resumes a pool from a snapshot (`resume_check`)
"""
import json
import os
import pickle
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from engines.decode import SamplingParams
from engines.pool import Request
from engines.vllm_engine import VLLMEngine
from engines.vllm_pool import VLLMPool
from models.decoder import completion_logprobs
from models.hf import build, iter_checkpoint, load_state, read_config
from models.tokenizer import Tokenizer
from tasks.data import load_rows, make_batch
from utils import dist  # noqa: E402


def forced(trainer, weights: dict, prompt: list, tokens: list, pad: int) -> torch.Tensor:
    """[T] the log-prob of each token given the prompt and the tokens before it, under `weights`."""
    load_state(trainer, iter(weights.items()))
    with torch.no_grad():
        batch = make_batch([prompt], torch.tensor([tokens]), torch.tensor([len(tokens)]), pad)
        return completion_logprobs(trainer, batch, 1.0)[0]


def resume_check(engine, trainer, pad: int, prompts: list, weights: dict, T: int) -> dict:
    """A resumed run's pool (roles/stream.py `save`/`resume`): two new requests run 5 engine steps, the
    pool's `state` goes through a pickle round trip (a checkpoint's), its requests are aborted (the
    saving run ends), and a fresh pool loads the state; the next update (version 2: `weights`) adds
    them to vLLM again, and they start over under it."""
    params, context = SamplingParams(2, 1.0, max_new_tokens=T), max(map(len, prompts)) + T
    pool = VLLMPool(engine, params, 4, context)
    requests = [Request((i,), p, i) for i, p in enumerate(prompts, start=2)]
    pool.admit(requests)
    early = sum(len(pool.step()) for _ in range(5))
    state = pickle.loads(pickle.dumps(pool.state()))
    pool.core.abort_request(list(pool.ids))
    fresh = VLLMPool(engine, params, 4, context)
    fresh.load(state)
    waiting = fresh.live  # rows the loaded requests take before they are in vLLM
    engine.version = 2
    fresh.update(lambda: engine.load_weights(iter(weights.items())))
    got = {}
    for _ in range(2 * T):  # (a request never added would hold its rows for ever)
        got.update({req.key: s for req, s in fresh.step()})
        if not fresh.live:
            break
    gaps, versions = [], set()
    assert sorted(got) == [r.key for r in requests], f"not every resumed request ended: {sorted(got)}"
    for req in requests:
        s = got[req.key]
        for j in range(2):
            L = int(s.lengths[j])
            lp = forced(trainer, weights, req.prompt, s.tokens[j, :L].tolist(), pad)
            gaps.append(float((s.logprobs[j, :L] - lp).abs().max()))
            versions |= set(s.token_versions[j, :L].tolist())
    return {"early": early, "waiting": waiting, "keys": sorted(got), "versions": sorted(versions),
            "gap": max(gaps)}


def main():
    model_dir, mode = sys.argv[1], sys.argv[2]
    dist.init(timeout_s=120)  # as in training: the process group exists before the engine
    tok = Tokenizer(model_dir)
    rows = load_rows("builtin:carries", "eval", "prompt", None)[:16]
    more = [tok.encode(*tok.render(r["prompt"])) for r in rows]
    prompts = more[:4]
    T = 160
    engine = VLLMEngine(model_dir, tok, "cpu", torch.float32, max_model_len=max(map(len, prompts)) + T)
    old = {k: v.clone() for k, v in iter_checkpoint(model_dir)}
    noise = torch.Generator().manual_seed(1)
    new = {k: v + 0.02 * torch.randn(v.shape, generator=noise) for k, v in old.items()}
    engine.version = 0
    engine.load_weights(iter(old.items()))  # vLLM labels the tokens "0" from here
    pool = VLLMPool(engine, SamplingParams(2, 1.0, max_new_tokens=T), 4, max(map(len, prompts)) + T)
    requests = [Request((i,), p, i) for i, p in enumerate(prompts[:2])]
    pool.admit(requests)
    got = {}
    for _ in range(20):
        got.update({req.key: s for req, s in pool.step()})
    early = len(got)
    engine.version = 1
    pool.update(lambda: engine.load_weights(iter(new.items())), drop=mode == "drop")
    evaluated = pool.evaluate(prompts[2:], SamplingParams(1, 1.0, max_new_tokens=T), [5, 6])
    while pool.live:
        got.update({req.key: s for req, s in pool.step()})
    trainer = build(read_config(model_dir)).eval()
    samples = []
    for req in requests:
        s = got[req.key]
        for j in range(2):
            L = int(s.lengths[j])
            versions, tokens = s.token_versions[j, :L], s.tokens[j, :L].tolist()
            under = {v: forced(trainer, w, req.prompt, tokens, tok.pad_id) for v, w in ((0, old), (1, new))}
            mine = torch.where(versions == 0, under[0], under[1])  # each token under its own version
            other = torch.where(versions == 0, under[1], under[0])
            gap, gap_other = ((s.logprobs[j, :L] - x).abs().max() for x in (mine, other))
            samples.append({"versions": versions.tolist(), "gap": float(gap), "gap_other": float(gap_other)})
    evals = []
    for i in range(2):
        L = int(evaluated.lengths[i])
        lp = forced(trainer, new, prompts[2 + i], evaluated.tokens[i, :L].tolist(), tok.pad_id)
        evals.append(float((evaluated.logprobs[i, :L] - lp).abs().max()))
    # seeded prompts over vLLM's default step budget of 4,096 tokens, none cached (failed on CPU when
    # prefilled in chunks: engines/vllm_engine.py)
    engine.llm.reset_prefix_cache()
    big = engine.generate(more, SamplingParams(8, 1.0, max_new_tokens=4), list(range(16)))
    resumed = resume_check(engine, trainer, tok.pad_id, prompts[:2], old, T) if mode == "drop" else None
    engine.close()
    big_batch = [8 * sum(map(len, more)), len(big.lengths)]  # prompt tokens, samples
    print(json.dumps({"early": early, "samples": samples, "eval_gaps": evals,
                      "eval_version": evaluated.version, "big_batch": big_batch, "resumed": resumed}))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # not interpreter exit: see utils/dist.py exit_now (SIGABRT in gloo's threads)
