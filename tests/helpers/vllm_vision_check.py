"""Run by tests/test_vllm_vision.py in its own process (vLLM binds threads and builds groups): a tiny
Qwen2-VL in VLLMEngine, in a venv without torchvision. Prints JSON on its last line.

    python tests/helpers/vllm_vision_check.py DIR

DIR holds the checkpoint (DIR/model, as transformers 5 saves it), the same with one vision weight
changed (DIR/perturbed) and the prompts (DIR/prompts.pt: token ids with the image pads expanded,
the images, the pixel limits they were sized with). Two engines, one after the other:
  own      the engine core in a child process (own_process, as disaggregate): greedy tokens of
           the prompts (no weights sent: it serves the checkpoint). First, and with an empty
           VLLM_CACHE_ROOT (DIR/vllm-cache): no model info is cached, so vLLM inspects the model
           in a subprocess.
  inproc   the engine in this process (colocate): greedy tokens and log-probs of the prompts; the
           same after load_weights of DIR/perturbed under our (legacy) names; a video request.
So each of vLLM's processes that imports the model's code runs once: this one, the inspection
subprocess, the engine core's child (the in-process engine reuses this process's model info).
"""
import json
import os
import sys
import time
import traceback

import psutil
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from engines.decode import SamplingParams
from engines.vllm_engine import VLLMEngine
from models.tokenizer import Tokenizer


class Prompt(list):
    """What models.vision.ImagePrompt is to the engine: token ids (pads expanded) with `.images`, and
    maybe the pixel limits they were sized with."""

    def __init__(self, ids, images, pixels=()):
        super().__init__(ids)
        self.images = images
        if pixels:
            self.min_pixels, self.max_pixels = pixels


def legacy_names(path):
    """A transformers-5 checkpoint's tensors under the names our model uses (model.layers.*,
    visual.*, lm_head.weight)."""
    from safetensors.torch import load_file

    for name, t in load_file(os.path.join(path, "model.safetensors")).items():
        name = name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
        yield name, t


def greedy(engine, prompts):
    out = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=8), [0] * len(prompts))
    rows = []
    for i in range(len(prompts)):
        n = int(out.lengths[i])
        rows.append({"tokens": out.tokens[i, :n].tolist(), "logprobs": out.logprobs[i, :n].tolist()})
    return rows


def main(d):
    saved = torch.load(os.path.join(d, "prompts.pt"), weights_only=True)
    prompts = []
    for ids, image, pixels in zip(saved["ids"], saved["images"], saved["pixels"]):
        prompts.append(Prompt(ids, [image.numpy()], pixels))
    model = os.path.join(d, "model")
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(d, "vllm-cache")  # empty: no model info cached
    r = {}
    start = time.time()
    own = VLLMEngine(model, Tokenizer(model), "cpu", torch.float32, max_model_len=256, own_process=True)
    r["own"] = {"build_s": time.time() - start, "first": greedy(own, prompts)}
    # own_process switched vLLM's multiprocessing on for this process; the next engine lives here (an
    # in-process engine first would not do: its engine core freezes vLLM's environment variables)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    start = time.time()
    engine = VLLMEngine(model, Tokenizer(model), "cpu", torch.float32, max_model_len=256)
    r["inproc"] = {"build_s": time.time() - start, "first": greedy(engine, prompts)}
    engine.version = 1
    engine.load_weights(legacy_names(os.path.join(d, "perturbed")))
    r["inproc"]["perturbed"] = greedy(engine, prompts)
    try:
        video = saved["images"][0][None].repeat(2, 1, 1, 1).numpy()  # [frames, H, W, 3]
        engine.llm.generate({"prompt_token_ids": list(prompts[0]), "multi_modal_data": {"video": video}},
                            use_tqdm=False)
        r["video"] = "accepted"
    except Exception as e:
        r["video"] = f"{type(e).__name__}: {e}"
    r["model_info"] = os.listdir(os.path.join(d, "vllm-cache", "modelinfos"))  # the inspection's result
    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    code = 0
    try:
        main(sys.argv[1])
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:  # not engine.close(): the own-process engine's shutdown waits 5 s for its core, then kills it
        for child in psutil.Process().children(recursive=True):
            child.kill()
    os._exit(code)
