"""The launch recipes of docs/scale.md with the memory plan beside each (memory.py): Qwen2.5 and
Qwen3 from 0.5B to 8B on 1, 8 and 16 GPUs of 80 GiB, vLLM as the engine, bf16. The shapes are
those of the published config.json files (their parameter counts are printed to check them).
An estimate, not a measurement: no GPU has run these here.

    python bench/memory_plan.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from memory import GIB, Workload, estimate
from models.config import ModelConfig

DEVICE = 80 * GIB
QWEN = dict(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6)
MODELS = {  # hidden, intermediate, layers, heads, kv heads, head_dim, tied embeddings
    "Qwen2.5-0.5B": ModelConfig(**QWEN, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2, head_dim=64),
    "Qwen3-0.6B": ModelConfig(**QWEN, architecture="Qwen3ForCausalLM", attention_bias=False, hidden_size=1024,
                              intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=128),
    "Qwen2.5-1.5B": ModelConfig(**QWEN, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                num_attention_heads=12, num_key_value_heads=2, head_dim=128),
    "Qwen3-1.7B": ModelConfig(**QWEN, architecture="Qwen3ForCausalLM", attention_bias=False, hidden_size=2048,
                              intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=128),
    "Qwen2.5-3B": ModelConfig(**QWEN, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                              num_attention_heads=16, num_key_value_heads=2, head_dim=128),
    "Qwen3-4B": ModelConfig(**QWEN, architecture="Qwen3ForCausalLM", attention_bias=False, hidden_size=2560,
                            intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128),
    "Qwen2.5-7B": ModelConfig(**{**QWEN, "vocab_size": 152064}, hidden_size=3584, intermediate_size=18944,
                              num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                              head_dim=128, tie_word_embeddings=False),
    "Qwen3-8B": ModelConfig(**QWEN, architecture="Qwen3ForCausalLM", attention_bias=False, hidden_size=4096,
                            intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
# (models, GPUs, placement, rollout ranks, prompts per step, micro-batch)
RECIPES = [(["Qwen2.5-0.5B", "Qwen3-0.6B", "Qwen2.5-1.5B", "Qwen3-1.7B"], 1, "colocate", 0, 16, 2),
           (["Qwen2.5-3B", "Qwen3-4B", "Qwen2.5-7B", "Qwen3-8B"], 8, "colocate", 0, 64, 1),
           (["Qwen2.5-7B", "Qwen3-8B"], 16, "disaggregate", 4, 128, 1)]
PROMPT, NEW, GENERATIONS = 512, 1024, 8


def flags(gpus, placement, rollout, prompts, micro):
    nodes = f"--nnodes {gpus // 8} --nproc-per-node 8 --rdzv-backend c10d ..." if gpus > 8 else \
        f"--nproc-per-node {gpus}"
    split = f" --placement disaggregate --rollout-ranks {rollout} --max-staleness 1" if rollout else ""
    return (f"torchrun {nodes} train_grpo.py --model MODEL --engine vllm --param-dtype bfloat16{split} "
            f"--prompts-per-step {prompts} --num-generations {GENERATIONS} --max-prompt-tokens {PROMPT} "
            f"--max-new-tokens {NEW} --micro-batch-size {micro}")


def main():
    print(f"Each rank's estimate, GiB, of {DEVICE / GIB:.0f} GiB per GPU (vLLM takes half while it generates "
          f"and sleeps while the trainer trains; prompts <= {PROMPT} tokens, completions <= {NEW}).\n")
    for models, gpus, placement, rollout, prompts, micro in RECIPES:
        print(f"`{flags(gpus, placement, rollout, prompts, micro)}`\n")
        print("| model | params | trainer rank | its largest phase | rollout rank |")
        print("|---|---|---|---|---|")
        dp = gpus - rollout
        for name in models:
            cfg = MODELS[name]
            w = Workload(param_bytes=2, micro_batch=micro, prompt_len=PROMPT, new_tokens=NEW,
                         rows=prompts // dp * GENERATIONS, gen_rows=prompts // dp * GENERATIONS,
                         vllm_share=0.5, device_bytes=DEVICE, packed_decode=False)
            plan = estimate(cfg, placement, dp, rollout, w)
            trainer = plan["trainer"]
            phase, parts = max(trainer.phases.items(), key=lambda kv: sum(kv[1].values()))
            shown = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items())
            roll = f"{plan['rollout'].total() / GIB:.1f}" if "rollout" in plan else "-"
            print(f"| {name} | {cfg.num_params() / 1e9:.2f}B | {trainer.total() / GIB:.1f} "
                  f"| {phase}: {shown} | {roll} |")
        print()


if __name__ == "__main__":
    main()
