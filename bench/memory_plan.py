"""The launch recipes of docs/scale.md with the memory plan beside each (memory.py): Qwen2.5 and
Qwen3 from 0.5B to 8B on 1, 8 and 16 GPUs of 80 GiB, vLLM as the engine, bf16. The shapes are
those of the published config.json files (their parameter counts are printed to check them).
Then Qwen3-30B-A3B on 8 and 64 GPUs: FSDP2 alone (what this trainer runs: each block gathered whole,
its 128 experts with it) against expert parallelism (a plan, not built: `expert_parallel`).
An estimate, not a measurement: no GPU has run these here.

    python bench/memory_plan.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from memory import GIB, Workload, estimate
from models.config import ModelConfig, Moe

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
# Qwen3-30B-A3B's config.json: 48 layers, every MLP sparse, 128 experts of 768, 8 per token
MOE_30B = ModelConfig(**QWEN, architecture="Qwen3MoeForCausalLM", attention_bias=False, hidden_size=2048,
                      intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                      num_key_value_heads=4, head_dim=128, tie_word_embeddings=False,
                      moe=Moe(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                              norm_topk_prob=True))
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


def expert_parallel(cfg: ModelConfig, dp: int, ep: int, w: Workload) -> dict:
    """Qwen3-MoE's training phase per rank under FSDP2 alone (ep 1) or with its experts split over
    groups of `ep` ranks (torchtitan's layout: each rank holds E/ep experts of every sparse block, the
    rest of the block FSDP-sharded over all dp ranks, the experts FSDP-sharded over the dp/ep ranks
    that hold the same ones) -> {name: bytes} of what differs, and the bytes each rank moves per step.
    Held memory (fp32 master and Adam, 12 bytes per parameter over dp) is the same either way.
    Traffic: FSDP gathers every block's weights in each micro-batch's forward and again in its
    backward, and reduce-scatters their gradients once a step (the block in p per rank, x (g-1)/g, g
    its group); the experts' tokens go by all-to-all instead, each token's hidden state to its k
    experts and back, in the forward and twice in the backward (activations and their gradients)."""
    m, h, p = cfg.moe, cfg.hidden_size, w.param_bytes
    expert = 3 * h * m.moe_intermediate_size  # one expert's parameters
    dense = cfg.layer_params(0) - m.num_experts * expert  # attention, router, norms of a sparse block
    local = m.num_experts // ep  # the experts one rank runs
    tokens = w.rows * (w.prompt_len + w.new_tokens)  # one step's tokens on this rank (every row at its bound)
    group = dp // ep  # the ranks that hold the same experts (their FSDP group)
    gathered = 2 * (dense + local * expert) * p  # the current and the prefetched block, unsharded
    passes = 2 * -(-w.rows // w.micro_batch) + 1  # gathers of each block a step, and its reduce-scatter
    per_block = (dense * (dp - 1) / dp + local * expert * (group - 1) / group) * p  # gathered by one rank
    fsdp_bytes = cfg.num_hidden_layers * passes * per_block
    sent = 3 * 2 * tokens * m.num_experts_per_tok * h * p * (ep - 1) / ep  # one block's all-to-all
    a2a = 0 if ep == 1 else cfg.num_hidden_layers * sent
    return {"gathered": gathered, "fsdp_traffic": fsdp_bytes, "all_to_all": a2a,
            "held": 12 * cfg.num_params() / dp}


def moe_plans():
    """Qwen3-30B-A3B: what this trainer's FSDP2 needs per rank on 8 and 64 GPUs, and what expert
    parallelism would change (docs/scale.md)."""
    cfg = MOE_30B
    total, active = cfg.num_params() / 1e9, cfg.num_params(active=True) / 1e9
    print(f"Qwen3-30B-A3B ({total:.1f}B parameters, {active:.2f}B "
          f"active per token), bf16, {GENERATIONS} samples per prompt, prompts <= {PROMPT}, "
          f"completions <= {NEW}.\n")
    print("| GPUs | layout | trainers | EP | held GiB | gathered GiB | largest train phase GiB "
          "| rank total GiB | FSDP traffic GB/step | all-to-all GB/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for gpus, placement, rollout, prompts, eps in ((8, "colocate", 0, 64, (1, 8)),
                                                   (64, "disaggregate", 16, 512, (1, 8, 16))):
        dp = gpus - rollout
        w = Workload(param_bytes=2, micro_batch=1, prompt_len=PROMPT, new_tokens=NEW,
                     rows=prompts // dp * GENERATIONS, gen_rows=prompts // dp * GENERATIONS,
                     vllm_share=0.5, device_bytes=DEVICE, packed_decode=False)
        plan = estimate(cfg, placement, dp, rollout, w)["trainer"]
        train = plan.phases["train"]
        for ep in eps:
            ex = expert_parallel(cfg, dp, ep, w)
            phase = sum(train.values()) - train["gathered"] + ex["gathered"]
            total = sum(plan.held.values()) + max([phase] + [sum(v.values()) for k, v in plan.phases.items()
                                                             if k != "train"])
            print(f"| {gpus} | {placement}{f' ({rollout} rollout)' if rollout else ''} | {dp} | {ep} "
                  f"| {sum(plan.held.values()) / GIB:.1f} | {ex['gathered'] / GIB:.2f} | {phase / GIB:.1f} "
                  f"| {total / GIB:.1f} | {ex['fsdp_traffic'] / 1e9:.0f} | {ex['all_to_all'] / 1e9:.0f} |")
    print()


if __name__ == "__main__":
    main()
    moe_plans()
