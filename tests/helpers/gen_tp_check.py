"""Run under torchrun (2 ranks) by tests/test_gen_tp.py: the same model generates the same
prompts on each rank as one whole native engine (K=1) and as a --gen-tp 2 pair (engines/tp.py),
greedily and sampled; each rank writes both outputs to OUT/rank{r}.pt."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from engines.decode import SamplingParams
from engines.make import make_engine
from models.hf import iter_checkpoint, read_config
from models.tokenizer import Tokenizer
from utils import dist  # noqa: E402

model_dir, out = sys.argv[1], sys.argv[2]
rank, world, device = dist.init(timeout_s=60)
cfg, tok = read_config(model_dir), Tokenizer(model_dir)
# each rank its own prompts, of other lengths (left padding differs from the pair's batch)
prompts = [tok.encode(p) for p in (["12+7=", "3+45=", "8+8="] if rank == 0 else ["100+1=", "6+7="])]
seeds = [rank * 10 + i for i in range(len(prompts))]
runs = {"greedy": SamplingParams(1, 0.0, 1.0, 0, 8), "sampled": SamplingParams(3, 1.0, 1.0, 0, 8)}
group = torch.distributed.new_group([0, 1])
saved = {}
for k, tp_group in ((1, None), (2, group)):
    engine = make_engine("native", model_dir, cfg, tok, device, torch.float32, 64, tp_group=tp_group)
    engine.load_weights(iter_checkpoint(model_dir))
    for name, params in runs.items():
        got = engine.generate(prompts, params, seeds)
        saved[f"k{k}_{name}_tokens"], saved[f"k{k}_{name}_logprobs"] = got.tokens, got.logprobs
        saved[f"k{k}_{name}_lengths"] = got.lengths
    if k == 2:  # a rank with no prompts still takes part; the other gets its own
        got = engine.generate(prompts if rank == 0 else [], runs["greedy"], seeds if rank == 0 else [])
        saved["k2_alone_rows"] = torch.tensor(len(got.lengths))
torch.save(saved, os.path.join(out, f"rank{rank}.pt"))
dist.close()
