import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two tests at a time on 2 cores: each rank on one thread. Two ranks on two threads each would
    # put 4 OpenMP pools on 2 cores, whose barriers spin while a member waits to be scheduled (a
    # 1-rank memory run: 22 s alone, 75 s beside another test on 2 threads)
    os.environ.setdefault("RL_THREADS", "1")

from assets.make import make_tokenizer


def pytest_configure(config):
    config.addinivalue_line("markers", "reordered: compares two runs whose float sums are ordered "
                            "differently (tests/helpers/runs.py's rule; .ci/arithmetic_orders.sh runs them "
                            "under other kernels)")


def pytest_report_header(config):
    """The arithmetic this run's ranks get (they fork from a server that inherits this environment)."""
    knobs = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR",
                                              "RL_THREADS") if k in os.environ]
    return f"arithmetic: ATen {torch.backends.cpu.get_cpu_capability()}; {' '.join(knobs) or 'no overrides'}"


def hf_checkpoint(path, arch="qwen2", seed=0, **kw):
    """A random transformers model saved in HF format, with the built-in task's tokenizer."""
    import transformers

    eos = make_tokenizer(path)
    base = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=512, eos_token_id=eos)
    base.update(kw)
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**base))
    elif arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**base))
    elif arch == "qwen3_moe":  # kw: num_experts, num_experts_per_tok, moe_intermediate_size, ...
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**base))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base))
    with torch.no_grad():  # HF starts norms at 1 and biases at 0: randomise them so that tests see them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):  # a MoE router: decisive choices, not near-uniform ones
                p.normal_(0.0, 0.3)
    model.eval().save_pretrained(path)
    return model


# the files with the longest tests or groups (a file whose tests share a fixture runs on one
# worker as one block: test_flow_run ~95 s, test_lora ~100 s), longest first
FIRST = ["test_vllm", "test_rebalance", "test_lora", "test_disaggregate", "test_flow_run",
         "test_checkpoint", "test_memory", "test_tools_run", "test_train_ppo", "test_train_grpo",
         "test_vllm_vision", "test_fsdp", "test_dynamic_sampling", "test_vl_run"]


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group marks into node ids
def pytest_collection_modifyitems(items):
    """The README runs the suite on 2 workers (pytest-xdist, `-n 2 --dist loadgroup`): one test's
    ranks rarely keep both cores busy (start-up, a rank waiting on another), two tests do. A test
    that reads a module or session fixture runs on the worker of its file's other such tests, so
    that the fixture's launches happen once; every test that reads grpo_run (in two files) on one
    worker too. The files holding the longest tests go first, so that the last minutes are not one
    vLLM test alone on one worker (the tail of a run in file order: 14m53s). Without xdist the
    marks do nothing."""
    order = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: order.get(item.module.__name__, len(FIRST)))
    for item in items:
        defs = item._fixtureinfo.name2fixturedefs
        shared = [name for name, d in defs.items() if d[-1].scope in ("module", "session")]
        shared = [name for name in shared if name != "tiny_hf"]  # cheap: made again where needed
        if "grpo_run" in shared:
            item.add_marker(pytest.mark.xdist_group("grpo_run"))
        elif shared:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(scope="session")
def grpo_run(tmp_path_factory):
    """(run dir, stdout) of a 2-rank colocated GRPO run with test_train_grpo.SEEDED's flags (a
    reference model, a reward that fails now and then), launched once for the tests that read
    it: test_train_grpo checks what it logs and that a rerun is identical, test_disaggregate
    that the disaggregated run is the same. Read it, never write into it."""
    from test_fsdp import torchrun
    from test_train_grpo import SEEDED

    path = str(tmp_path_factory.mktemp("grpo") / "run")
    return path, torchrun(2, "train_grpo.py", *SEEDED, "--run-dir", path).stdout


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """(path, transformers model) of a small random Qwen2 checkpoint."""
    path = str(tmp_path_factory.mktemp("tiny-qwen2"))
    return path, hf_checkpoint(path)


# Every script a test runs under torchrun ends with utils.dist.exit_now(), never a plain
# dist.close() and interpreter exit: after gloo has run, normal interpreter exit aborts in about
# 2% of runs ("terminate called without an active exception", exit -6, gloo threads releasing
# tensors during finalization). That abort was the flake behind the reruns these tests used to
# carry (an elastic restart and a 2-rank FSDP step): reproduced 2 times in 120 launches of
# tests/helpers/fsdp_step.py, 0 in 90 with exit_now. Ports are never picked ahead of binding:
# torchrun --standalone binds its stores to port 0, as dist.init does for a world of one.
