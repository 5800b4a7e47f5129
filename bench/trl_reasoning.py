"""Peer baseline for bench/grpo_vs_trl.py's reasoning shape: Hugging Face TRL's GRPOTrainer on a
checkpoint and a prompts file it is given, on CPU, no network. Run by grpo_vs_trl.py in TRL's own
virtual environment (it imports nothing of ours):

    .venv-trl/bin/python bench/trl_reasoning.py --model-dir DIR --prompts FILE.jsonl --steps 4

Each step generates prompts_per_step x num_generations completions in one `generate` and takes one
optimizer step over them in micro-batches of --micro-batch-rows rows (gradient accumulation; TRL
then reuses the sampling policy's log-probs as the old ones, as we do: no extra forward). The
reward is bench/common.py's parity_reward (the CRC32 of the completion text, mod 2), restated here
because this venv cannot import our modules. It prints one JSON line last: seconds per step (the
median after the first step) and, per step, the completions' mean and max length in tokens, from
TRL's own logs.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
import argparse
import json
import statistics
import time
import zlib

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

ap = argparse.ArgumentParser()
ap.add_argument("--model-dir", required=True)
ap.add_argument("--prompts", required=True, help="jsonl with a 'prompt' field per line")
ap.add_argument("--steps", type=int, default=4)
ap.add_argument("--prompts-per-step", type=int, default=8)
ap.add_argument("--num-generations", type=int, default=8)
ap.add_argument("--max-new-tokens", type=int, default=384)
ap.add_argument("--micro-batch-rows", type=int, default=8)
ap.add_argument("--lr", type=float, default=1e-12)
ap.add_argument("--workdir", default="/tmp/trl-reasoning")
args = ap.parse_args()

torch.manual_seed(0)
# tokenizer.json as it is: AutoTokenizer would load a Qwen2Tokenizer (the config's model_type), whose
# pre-tokenizer splits numbers into digits: 302 tokens for a prompt that is 258 in the file's own BPE
tok = PreTrainedTokenizerFast.from_pretrained(args.model_dir)
tok.padding_side = "left"
model = Qwen2ForCausalLM.from_pretrained(args.model_dir)
with open(args.prompts) as f:
    ds = Dataset.from_dict({"prompt": [json.loads(line)["prompt"] for line in f]})


def parity_reward(prompts, completions, **kw):
    return [float(zlib.crc32(c.encode()) % 2) for c in completions]


times = []


class StepTimer(TrainerCallback):
    def on_step_begin(self, a, s, c, **kw):
        self.t = time.perf_counter()

    def on_step_end(self, a, s, c, **kw):
        times.append(time.perf_counter() - self.t)


rows = args.prompts_per_step * args.num_generations
assert rows % args.micro_batch_rows == 0, "--micro-batch-rows must divide prompts x generations"
conf = GRPOConfig(
    output_dir=os.path.join(args.workdir, "out"), max_steps=args.steps,
    per_device_train_batch_size=args.micro_batch_rows,
    gradient_accumulation_steps=rows // args.micro_batch_rows,
    num_generations=args.num_generations, max_completion_length=args.max_new_tokens,
    learning_rate=args.lr, logging_steps=1, use_vllm=False, use_cpu=True, bf16=False,
    gradient_checkpointing=False, report_to="none", save_strategy="no", temperature=1.0, seed=0,
)
trainer = GRPOTrainer(model=model, reward_funcs=[parity_reward], args=conf, train_dataset=ds,
                      processing_class=tok, callbacks=[StepTimer()])
trainer.train()
logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
print(json.dumps({
    "tool": "trl.GRPOTrainer", "s_per_step_median": round(statistics.median(times[1:] or times), 4),
    "step_times": [round(t, 3) for t in times], "mean_length": [h["completions/mean_length"] for h in logs],
    "max_length": [h["completions/max_length"] for h in logs], "torch_threads": torch.get_num_threads(),
}))
