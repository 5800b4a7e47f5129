"""Run by tests/test_vllm.py in its own process: the same greedy tool episodes of builtin:multiply
on the native engine and on vLLM (prefix caching on), with the tool run for real. The shipped
model calls the tool on ~1 in 5 samples, never greedily, so each episode's first turn is a call
of the tool (`Calls`); the turn after the tool's reply is each engine's own. Prints JSON on its
last line: the episodes' tokens agree, and how many called the tool."""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from engines.base import Samples
from engines.decode import SamplingParams
from engines.episodes import EnvArgs, Episodes, tokenize
from engines.native import NativeEngine
from engines.vllm_engine import VLLMEngine
from models.hf import iter_checkpoint, read_config
from models.tokenizer import Tokenizer
from tasks.data import multiply_rows

MODEL = os.path.join(ROOT, "assets", "tool-tiny")


class Calls:
    """An engine whose first turn (the prompts' own request, params.n samples each) is a call of
    multiply on the prompt's numbers; later turns are `engine`'s."""

    def __init__(self, engine, tok, first_turn: set):
        self.engine, self.tok, self.first_turn = engine, tok, first_turn

    def generate(self, prompts, params, seeds):
        if tuple(prompts[0]) not in self.first_turn:
            return self.engine.generate(prompts, params, seeds)
        rows = []
        for p in prompts:
            from assets.make import tool_call_text

            a, b = self.tok.tok.decode(p, skip_special_tokens=True).split("\n")[1].rstrip("=").split("*")
            rows.append(self.tok.encode(tool_call_text(a, b), special=False) + [min(self.tok.eos_ids)])
        T = max(map(len, rows))
        tokens = torch.tensor([r + [0] * (T - len(r)) for r in rows])
        return Samples(tokens, torch.zeros(tokens.shape), torch.tensor([len(r) for r in rows]),
                       ["stop"] * len(rows), [""] * len(rows))

    def close(self):
        self.engine.close()

if __name__ == "__main__":
    tok = Tokenizer(MODEL)
    cfg = EnvArgs(tools=("tasks.env:multiply",))
    cfg.check()
    rows = tokenize(multiply_rows("eval")[:32], tok, cfg, 64)[0]
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=96)
    native = NativeEngine(read_config(MODEL), tok)
    native.load_weights(iter_checkpoint(MODEL))
    outs = []
    for engine in (native, VLLMEngine(MODEL, tok, "cpu", "float32", cfg.context(64 + 96))):
        eps = Episodes(Calls(engine, tok, {tuple(r["ids"]) for r in rows}), cfg, tok, rows, 96)
        outs.append(eps.generate([r["ids"] for r in rows], params, list(range(len(rows)))))
        eps.close()
    a, b = outs
    same = [a.tokens[i, :int(a.lengths[i])].tolist() == b.tokens[i, :int(b.lengths[i])].tolist()
            for i in range(len(rows))]
    print(json.dumps({"same": sum(same), "episodes": len(rows),
                      "called": int((a.episode["tool_calls"] > 0).sum()),
                      "vllm_called": int((b.episode["tool_calls"] > 0).sum()),
                      "turns": a.episode["turns"].tolist(), "texts_equal": a.texts == b.texts}))
