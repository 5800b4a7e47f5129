"""Run by tests/test_vllm.py in its own process (vLLM binds threads and builds groups): weights
into a vLLM engine through vLLM's weight-transfer layer, as training sends them, checked after
each of several updates against the trainer's own model. Prints JSON on its last line.

  MODEL inproc            the engine in this process (colocate): VLLMEngine.load_weights
  MODEL gloo B1 B2 ...    its core in a child process (disaggregate), one update per bucket size
                          B (bytes); this process is trainer 0 too (engines.vllm_transfer.TrainerEnd)
  MODEL trainer-dies      the engine's side, with trainer 0 in a child that dies mid-update
  MODEL rollout-dies      trainer 0's side, with the engine's process killed mid-update
"""
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from engines.decode import SamplingParams
from engines.native import NativeEngine
from engines.vllm_engine import VLLMEngine
from models.decoder import completion_logprobs
from models.hf import build, iter_checkpoint, load_state, read_config
from models.tokenizer import Tokenizer
from tasks.data import arith_rows, make_batch
from utils import dist  # noqa: E402

TIMEOUT_S = 20


def new_weights(model_dir, seed):
    """The checkpoint plus noise: every update changes every tensor."""
    g = torch.Generator().manual_seed(seed)
    return [(k, t + torch.randn(t.shape, generator=g) * t.std() * 0.3) for k, t in iter_checkpoint(model_dir)]


def specs_of(weights):
    return [(name, tuple(t.shape), t.dtype) for name, t in weights]


def diff_rows(a, b) -> list[int]:
    """Rows whose tokens differ."""
    rows = []
    for i in range(len(a.lengths)):
        if a.tokens[i, :a.lengths[i]].tolist() != b.tokens[i, :b.lengths[i]].tolist():
            rows.append(i)
    return rows


def trainer_peer(model_dir):
    """A trainer 0 that opens the group, hands its rendezvous to the parent (stdout), and dies
    after sending a third of an update's tensors."""
    from engines.vllm_transfer import TrainerEnd

    weights = new_weights(model_dir, 1)
    end = TrainerEnd("gloo", specs_of(weights), 1, 1024, TIMEOUT_S)
    print(json.dumps(end.worker_info(1)), flush=True)
    end.connect()

    def dying():
        for i, item in enumerate(weights):
            if i == len(weights) // 3:
                os._exit(3)  # as a kill -9: no goodbye to the group
            yield item

    end.send(dying())


def rollout_peer(model_dir, info):
    """An engine in its own process that joins, starts an update and is killed while it receives."""
    tok = Tokenizer(model_dir)
    engine = VLLMEngine(model_dir, tok, "cpu", torch.float32, max_model_len=64, own_process=True)
    print("joining", flush=True)
    engine.join_transfer(info)
    engine.llm.start_weight_update()
    print("receiving", flush=True)
    os.killpg(os.getpgid(0), signal.SIGKILL)  # itself and vLLM's engine process, mid-update


def main():
    model_dir, mode = sys.argv[1], sys.argv[2]
    if mode == "trainer-peer":
        return trainer_peer(model_dir)
    if mode == "rollout-peer":
        return rollout_peer(model_dir, json.loads(sys.argv[3]))
    dist.init(timeout_s=120)  # as in training: the process group exists before the engine
    tok = Tokenizer(model_dir)
    if mode == "rollout-dies":
        from engines.vllm_transfer import TrainerEnd

        weights = new_weights(model_dir, 1)
        end = TrainerEnd("gloo", specs_of(weights), 1, 1024, TIMEOUT_S)
        info = json.dumps(end.worker_info(1))
        peer = subprocess.Popen([sys.executable, __file__, model_dir, "rollout-peer", info],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        while peer.stdout.readline().strip() != "joining":  # its engine is up (tens of seconds)
            pass
        end.connect()
        while peer.stdout.readline().strip() != "receiving":
            pass
        peer.wait()
        t = time.perf_counter()
        error = ""
        try:
            for _ in range(3):  # a dead receiver shows by the second update at the latest
                end.send(iter(weights))
        except RuntimeError as e:
            error = str(e)
        print(json.dumps({"error": error, "seconds": time.perf_counter() - t}))
        return
    own = mode != "inproc"
    engine = VLLMEngine(model_dir, tok, "cpu", torch.float32, max_model_len=64, own_process=own)
    insecure = "VLLM_ALLOW_INSECURE_SERIALIZATION"
    assert insecure not in os.environ, "our code must not let vLLM unpickle what its IPC carries"
    if mode == "trainer-dies":
        peer = subprocess.Popen([sys.executable, __file__, model_dir, "trainer-peer"], stdout=subprocess.PIPE,
                                text=True)
        info = json.loads(peer.stdout.readline())
        engine.join_transfer(info)
        t = time.perf_counter()
        error = ""
        try:
            engine.receive_weights(specs_of(new_weights(model_dir, 1)))
        except Exception as e:  # vLLM re-raises the worker's error in this process
            error = f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - t
        engine.close()  # or vLLM's engine process outlives this one (holding its stdout open)
        print(json.dumps({"error": error, "seconds": seconds, "peer_rc": peer.wait()}))
        return
    cfg = read_config(model_dir)
    trainer = build(cfg).eval()  # the trainer's model, which the engine must follow
    native = NativeEngine(cfg, tok)
    prompts = [tok.encode(r["prompt"]) for r in arith_rows("eval")[:16]]
    seeds = list(range(16))
    greedy, sampled = SamplingParams(temperature=0, max_new_tokens=8), SamplingParams(n=4, max_new_tokens=8)
    rounds = [int(b) for b in sys.argv[3:]] or [0, 0, 0]
    # before any update: vLLM's own load of the checkpoint against the trainer's
    load_state(trainer, iter_checkpoint(model_dir))
    native.load_weights(iter_checkpoint(model_dir))
    g, ref = engine.generate(prompts, greedy, seeds), native.generate(prompts, greedy, seeds)
    first = g
    checks = {"greedy_diffs": diff_rows(g, ref), "texts": g.texts == ref.texts,
             "finish": g.finish_reasons == ref.finish_reasons}
    a, b = (engine.generate(prompts[:2], sampled, [3, 4]) for _ in range(2))
    checks["seeded"] = a.texts == b.texts  # the same seeds, the same samples
    out = []
    for k, bucket in enumerate(rounds):
        weights = new_weights(model_dir, k)
        load_state(trainer, iter(weights))
        native.load_weights(iter(weights))
        engine.version = k + 1
        if own:
            from engines.vllm_transfer import TrainerEnd

            end = TrainerEnd("gloo", specs_of(weights), 1, bucket, TIMEOUT_S)
            with ThreadPoolExecutor(max_workers=1) as pool:
                joined = pool.submit(engine.join_transfer, end.worker_info(1))
                end.connect()
                joined.result()
                receiving = pool.submit(engine.receive_weights, specs_of(weights))
                end.send(iter(weights))
                receiving.result()
        else:
            engine.load_weights(iter(weights))
        engine.version = -1  # the samples' version must come from vLLM (finish_weight_update), not from here
        g, ref = engine.generate(prompts, greedy, seeds), native.generate(prompts, greedy, seeds)
        s = engine.generate(prompts[:4], sampled, [7, 8, 9, 10])
        rows = [p for p in prompts[:4] for _ in range(4)]
        with torch.no_grad():
            batch = make_batch(rows, s.tokens, s.lengths, tok.pad_id)
            lp = completion_logprobs(trainer, batch, 1.0)  # [N, T]
        mask = torch.arange(s.tokens.shape[1])[None] < s.lengths[:, None]
        out.append({"bucket": bucket, "greedy_diffs": diff_rows(g, ref), "changed": diff_rows(g, first) != [],
                    "sampled_gap": float(((s.logprobs - lp).abs() * mask).max()),
                    "versions": [g.version, s.version], "sampled_distinct": len(set(s.texts)) > 1})
    engine.close()
    print(json.dumps({"first": checks, "rounds": out, "insecure": insecure in os.environ}))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # not interpreter exit: see utils/dist.py exit_now (SIGABRT in gloo's threads)
