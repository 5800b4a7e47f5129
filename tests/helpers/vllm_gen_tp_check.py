"""Run under torchrun (2 ranks) by tests/test_vllm.py: each rank's own prompts through a colocated
vLLM engine, --gen-tp K (1: one engine per rank; 2: the pair's vLLM TP workers inside the two
torchrun ranks, external_launcher), its weights streamed in as the trainer's sync streams them
(the full tensors: each TP worker's loader takes its shard). Greedy; each rank writes OUT/rank{r}.pt."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from engines import tp
from engines.decode import SamplingParams
from engines.make import make_engine
from models.hf import iter_checkpoint, read_config
from models.tokenizer import Tokenizer
from utils import dist

model_dir, out, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
rank, world, device = dist.init(timeout_s=120)
cfg, tok = read_config(model_dir), Tokenizer(model_dir)
prompts = [tok.encode(p) for p in (["12+7=", "3+45=", "8+8="] if rank == 0 else ["100+1=", "6+7="])]
engine = make_engine("vllm", model_dir, cfg, tok, device, torch.float32, 64,
                     tp_group=tp.group_of(rank, world, k, 120))
engine.load_weights(iter_checkpoint(model_dir))
seeds = [rank * 10 + i for i in range(len(prompts))]
got = engine.generate(prompts, SamplingParams(1, 0.0, 1.0, 0, 8), seeds)
torch.save({"tokens": got.tokens, "logprobs": got.logprobs, "lengths": got.lengths},
           os.path.join(out, f"rank{rank}.pt"))
engine.close()
dist.close()
