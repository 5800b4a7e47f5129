"""Run by tests/test_vllm.py in its own process (vLLM binds threads and builds groups):
greedy parity with the native engine, a weight update, greedy parity again. Prints JSON."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from utils.engines import NativeEngine, SamplingParams, VLLMEngine  # noqa: E402
from utils import dist  # noqa: E402
from utils.data import Tokenizer, arith_rows  # noqa: E402
from utils.model import iter_checkpoint, read_config  # noqa: E402

model_dir = sys.argv[1]
dist.init(timeout_s=120)  # as in training: the process group exists before the engine
tok = Tokenizer(model_dir)
prompts = [tok.encode(r["prompt"]) for r in arith_rows("eval")[:16]]
greedy = SamplingParams(temperature=0, max_new_tokens=8)
vllm_engine = VLLMEngine(model_dir, tok, "cpu", torch.float32, max_model_len=64)
native = NativeEngine(read_config(model_dir), tok)


def compare(a, b):
    """Rows whose greedy tokens differ, with the first differing position."""
    diffs = []
    for i in range(len(a.lengths)):
        x, y = a.tokens[i, :a.lengths[i]].tolist(), b.tokens[i, :b.lengths[i]].tolist()
        if x != y:
            diffs.append([i, next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))])
    return diffs


def lp_gap(a, b):
    m = torch.arange(a.tokens.shape[1])[None] < a.lengths[:, None]
    T = min(a.tokens.shape[1], b.tokens.shape[1])
    return float(((a.logprobs[:, :T] - b.logprobs[:, :T]).abs() * m[:, :T]).max())


native.load_weights(iter_checkpoint(model_dir))
v0, n0 = vllm_engine.generate(prompts, greedy, list(range(16))), native.generate(prompts, greedy, list(range(16)))
# new weights: the checkpoint plus noise, the same tensors into both engines
g = torch.Generator().manual_seed(0)
new = [(k, t + torch.randn(t.shape, generator=g) * t.std() * 0.3) for k, t in iter_checkpoint(model_dir)]
vllm_engine.load_weights(iter(new))
native.load_weights(iter(new))
v1, n1 = vllm_engine.generate(prompts, greedy, list(range(16))), native.generate(prompts, greedy, list(range(16)))
sampled = vllm_engine.generate(prompts[:2], SamplingParams(n=4, temperature=1.0, max_new_tokens=8), [3, 4])
again = vllm_engine.generate(prompts[:2], SamplingParams(n=4, temperature=1.0, max_new_tokens=8), [3, 4])
print(json.dumps({
    "before_diffs": compare(v0, n0), "after_diffs": compare(v1, n1), "changed": compare(v0, v1) != [],
    "lp_gap_before": lp_gap(v0, n0), "lp_gap_after": lp_gap(v1, n1),
    "finish": v0.finish_reasons == n0.finish_reasons, "texts": v0.texts == n0.texts,
    "sampled_distinct": len(set(sampled.texts)) > 1, "seeded": sampled.texts == again.texts,
}))
vllm_engine.close()
dist.exit_now(0)  # not dist.close(): see utils/dist.py exit_now (SIGABRT at interpreter exit)
