"""The memory plan (memory.py) against what runs measure on CPU.

A run's `perf/peak_mem_added_gib` is its peak RSS minus the peak before the models loaded. That
also counts what the first steps load lazily (torch.distributed's FSDP and DTensor code, ~0.1
GiB on CPU), which no model config predicts: so the test compares the estimate's growth with the
measured growth between a small and a 54x larger model, same flags, same layout. glibc keeps
freed heap memory for reuse, so the RSS peak would measure the allocator's history rather than
the live tensors; MALLOC_MMAP_THRESHOLD_ makes every allocation over 64 KiB its own mapping,
returned when freed."""
import pytest
import torch
import tyro
from conftest import hf_checkpoint
from test_fsdp import torchrun
from test_train_grpo import metrics

from memory import GIB, Need, Workload, estimate, for_run, generation, trainer_gib
from models.config import ModelConfig
from train_grpo import Args

TOLERANCE = 0.2  # of the measured growth
MID = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
           num_key_value_heads=2, head_dim=64)  # 23.1M parameters; the small one has 0.43M


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    small, mid = str(tmp_path_factory.mktemp("small")), str(tmp_path_factory.mktemp("mid"))
    hf_checkpoint(small)
    hf_checkpoint(mid, **MID)
    return small, mid


def measured(model, ranks, flags, run_dir):
    """(the printed estimate for the trainer ranks, their measured peak), in GiB."""
    p = torchrun(ranks, "train_grpo.py", "--model", model, "--steps", "2", "--prompts-per-step", "4",
                 "--num-generations", "4", "--eval-every", "0", "--max-new-tokens", "48",
                 "--rewards", "tests.helpers.rewards:length_bonus", *flags, "--run-dir", run_dir)
    added = max(r["perf/peak_mem_added_gib"] for r in metrics(run_dir) if not r.get("final"))
    return trainer_gib(p.stdout), added


@pytest.mark.parametrize("ranks,flags", [
    (1, ["--micro-batch-size", "16"]),  # one micro-batch: activations dominate
    (1, ["--micro-batch-size", "4"]),  # four: gradients wait beside each one's activations
    (2, ["--micro-batch-size", "4"]),  # FSDP2 halves the shards
    (2, ["--placement", "disaggregate", "--rollout-ranks", "1", "--micro-batch-size", "4"]),  # no engine
], ids=["colocate-1-mb16", "colocate-1-mb4", "colocate-2", "disaggregate-trainer"])
def test_the_estimate_grows_as_the_measured_peak(models, tmp_path, monkeypatch, ranks, flags):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the ranks get it (tests/launch.py: mallopt)
    small, mid = models
    said_small, seen_small = measured(small, ranks, flags, str(tmp_path / "small"))
    said_mid, seen_mid = measured(mid, ranks, flags, str(tmp_path / "mid"))
    said, seen = said_mid - said_small, seen_mid - seen_small
    print(f"{ranks} {flags}: estimate {said:.3f}, measured {seen:.3f} GiB ({said / seen - 1:+.0%})")
    assert seen > 0.25, (seen_small, seen_mid)  # the larger model is what the peak measures
    assert abs(said - seen) <= TOLERANCE * seen, (said, seen, said_mid, seen_mid)


def test_the_plan_follows_the_layout():
    cfg = ModelConfig(**MID)
    w = Workload(param_bytes=2, micro_batch=4, prompt_len=64, new_tokens=256, rows=16, gen_rows=16,
                 packed_decode=False)
    one, eight = estimate(cfg, "colocate", 1, 0, w)["trainer"], estimate(cfg, "colocate", 8, 0, w)["trainer"]
    P = cfg.num_params()
    assert one.held == {"weights": 4 * P, "adam": 8 * P} and eight.held == {"weights": 4 * P // 8, "adam": P}
    assert one.phases["generate"]["engine"] == 2 * P  # the engine's copy is whole on every rank
    assert one.phases["train"]["grads"] == 8 * eight.phases["train"]["grads"]
    taught_w = Workload(**{**w.__dict__, "teacher": ModelConfig(**MID)})
    taught = estimate(cfg, "colocate", 8, 0, taught_w)
    assert taught["trainer"].held["teacher"] == 4 * P // 8  # --teacher-model: sharded like the reference
    released = Workload(**{**taught_w.__dict__, "teacher_released": True})  # on a GPU, off between steps
    released = estimate(cfg, "colocate", 8, 0, released)["trainer"]
    assert "teacher" not in released.held and released.phases["teacher"] == {"teacher": 4 * P // 8}
    split = estimate(cfg, "disaggregate", 4, 4, w)
    assert "generate" not in split["trainer"].phases and set(split["rollout"].phases) == {"generate"}
    assert set(split["rollout"].held) == {"sync_buffers"}  # a rollout rank keeps no optimizer state
    gpu = Workload(**{**w.__dict__, "vllm_share": 0.5, "device_bytes": 80 * GIB})
    assert estimate(cfg, "colocate", 8, 0, gpu)["trainer"].phases["generate"] == {"vllm_pool": 40 * GIB}


def test_the_plan_knows_lora():
    """LoRA: moments and gradients for the adapters only, no reference copy (the actor, adapters off);
    the native engine keeps its base for the run and merges a copy of the adapted weights to generate."""
    from models.lora import LoraArgs, adapted, count

    cfg = ModelConfig(**MID)
    args = LoraArgs(lora_rank=16)
    L, M = count(cfg, args), adapted(cfg, args)
    full = Workload(param_bytes=2, micro_batch=4, prompt_len=64, new_tokens=256, rows=8, gen_rows=8,
                    reference=True, packed_decode=False)
    lora = Workload(**{**full.__dict__, "lora_params": L, "lora_merged": M})
    a, b = estimate(cfg, "colocate", 2, 0, full)["trainer"], estimate(cfg, "colocate", 2, 0, lora)["trainer"]
    P = cfg.num_params()
    assert 0 < L < P / 10 and M == 8 * (512 * 512 * 2 + 512 * 128 * 2 + 512 * 1408 * 3)
    assert b.held == {"weights": 4 * (P + L) // 2, "adam": 8 * L // 2, "engine_base": 2 * P}
    assert a.held["reference"] == 4 * P // 2 and b.phases["train"]["grads"] == 4 * L // 2
    assert b.phases["generate"]["engine"] == 2 * M < a.phases["generate"]["engine"] == 2 * P
    assert b.total() < a.total()
    split = estimate(cfg, "disaggregate", 2, 1, lora)
    assert split["rollout"].held["engine_base"] == 2 * P and "engine_base" not in split["trainer"].held


def test_the_peak_is_what_is_held_and_the_largest_phase():
    need = Need({"a": 3}, {"x": {"b": 1, "c": 4}, "y": {"d": 2}})
    assert need.total() == 3 + 5


def test_the_plan_knows_the_stream():
    """--stream (a native engine): the rollout rank's pool has --stream-rows rows, and it holds K + 1
    weight versions received and not yet put in, and an evaluator engine for the held-out prompts;
    with vLLM, neither (its worker takes the weights, its pool evaluates). From the flags, as
    train_grpo.py prints it."""
    cfg = ModelConfig(**MID)
    P = cfg.num_params()
    flags = ["--placement", "disaggregate", "--rollout-ranks", "1", "--max-staleness", "2", "--stream",
             "--prompts-per-step", "8", "--num-generations", "4", "--max-new-tokens", "32",
             "--eval-every", "5"]
    w = Workload(param_bytes=4, micro_batch=4, prompt_len=16, new_tokens=32, rows=16, gen_rows=16,
                 stream_rows=24, stream_versions=3, stream_eval_rows=5)
    plan = estimate(cfg, "disaggregate", 2, 1, w)
    rollout, trainer = plan["rollout"], plan["trainer"]
    assert rollout.held["staged"] == 3 * 4 * P  # K + 1 = 3 copies in fp32
    evaluator = generation(cfg, 5, 48, w)  # its weights, packed copy and KV cache
    assert rollout.held["evaluator"] == sum(evaluator.values()) > 2 * 4 * P
    assert rollout.phases["generate"] == generation(cfg, 24, 48, w)  # the pool's rows
    assert "staged" not in trainer.held and "evaluator" not in trainer.held
    L, M = 1000, 2000  # LoRA: adapters of L parameters, M adapted weights (the native engine merges)
    lora = estimate(cfg, "disaggregate", 2, 1, Workload(**{**w.__dict__, "lora_params": L, "lora_merged": M}))
    assert lora["rollout"].held["staged"] == 3 * 4 * L  # after the base, each version is its adapters
    merged, base = 4 * M, 4 * P  # the evaluator's merged copy and its own base
    assert lora["rollout"].held["evaluator"] == evaluator["packed"] + evaluator["kv"] + merged + base
    said = for_run(tyro.cli(Args, args=flags), cfg, "disaggregate", 2, 1, torch.device("cpu"), 16, 10)
    assert f"staged {3 * 4 * P / 2**20:.2f}" in said and "evaluator" in said, said
    vllm = for_run(tyro.cli(Args, args=[*flags, "--engine", "vllm", "--stream-swap", "asap"]), cfg,
                   "disaggregate", 2, 1, torch.device("cpu"), 16, 10)
    assert "staged" not in vllm and "evaluator" not in vllm, vllm
    plain = for_run(tyro.cli(Args, args=[f for f in flags if f != "--stream"]), cfg, "disaggregate", 2, 1,
                    torch.device("cpu"), 16, 10)
    assert "staged" not in plain, plain
