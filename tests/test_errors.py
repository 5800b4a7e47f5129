"""A user's mistake ends the run with one `error:` line and no traceback from the workers; a
failed reward is left out of its group and of the loss."""
import dataclasses
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import typing
from functools import partial
from typing import Literal

import pytest
import torch
import tyro
from test_fsdp import ROOT, torchrun
from test_train_grpo import TINY, no_eval
from test_train_ppo import PPO_TINY

from models.lora import write_peft
from models.tokenizer import train_tokenizer
from utils import errors

# a frame of our own code in a traceback (torch's own utils/ excluded)
OUR_FRAME = re.compile(r'File "[^"]*(train_(grpo|ppo|rm)\.py|placement\.py|roles/\w+\.py'
                       r'|(?<!torch)/utils/\w+\.py)"')


def make_inputs(tmp):
    """Bad files for the data and checkpoint cases."""
    (tmp / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=" "answer": "4"}\n')
    (tmp / "int_prompt.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 7, "answer": "4"}\n')
    (tmp / "list_answer.jsonl").write_text('{"prompt": "1+1=", "answer": ["2"]}\n')
    (tmp / "junk.parquet").write_bytes(bytes(range(256)))
    shutil.copytree(os.path.join(ROOT, "assets/arith-tiny"), tmp / "truncated")
    weights = tmp / "truncated" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    shutil.copytree(os.path.join(ROOT, "assets/arith-tiny"), tmp / "rm_without_pad")
    config = json.loads((tmp / "rm_without_pad" / "config.json").read_text())
    config["architectures"] = ["Qwen2ForSequenceClassification"]
    config["id2label"] = {"0": "LABEL_0"}  # one score: without id2label transformers reads 2 labels
    (tmp / "rm_without_pad" / "config.json").write_text(json.dumps(config))
    shutil.copytree(os.path.join(ROOT, "assets/arith-tiny"), tmp / "yarn")  # Qwen2.5's model card
    config = json.loads((tmp / "yarn" / "config.json").read_text())
    config["rope_scaling"] = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
    (tmp / "yarn" / "config.json").write_text(json.dumps(config))
    shutil.copytree(os.path.join(ROOT, "assets/arith-tiny"), tmp / "other_tokenizer")
    train_tokenizer(["another corpus, other merges"] * 10, str(tmp / "other_tokenizer"))
    shutil.copytree(os.path.join(ROOT, "assets/arith-tiny"), tmp / "no_config")  # weights, no config.json
    os.remove(tmp / "no_config" / "config.json")
    write_peft(str(tmp / "adapter"), {}, 8, 16.0, base="assets/arith-tiny")  # what a --lora-rank run exports


CASES = [  # (flags, what the error line must say)
    # flag ranges, caught before the process group
    (["--lr", "-1"], "--lr -1.0: use a positive learning rate"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: use 1 or more"),
    (["--num-generations", "1"], "--num-generations 1: use 2 or more"),
    (["--rewards", "code"], "--rewards code runs each completion with its row's `tests` column, which the "
     "dataset has not (its columns: answer, ids, prompt, text)"),
    (["--num-generations", "1", "--teacher-model", "assets/arith-teacher"], "(1 only for distillation alone"),
    (["--teacher-model", "{tmp}/other_tokenizer"], "--teacher-model {tmp}/other_tokenizer has another "
     "tokenizer than --model assets/arith-tiny: the teacher scores the policy's token ids"),
    (["--teacher-model", "{tmp}/nothing"], "--teacher-model: checkpoint directory"),
    (["--teacher-model", "{tmp}/no_config"], "--teacher-model {tmp}/no_config has no config.json: point "
     "--teacher-model at a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)"),
    (["--distill-coef", "0", "--teacher-model", "assets/arith-teacher"], "--distill-coef 0.0: use a"),
    (["--dynamic-sampling", "--teacher-model", "assets/arith-teacher", "--reward-weights", "0"],
     "--dynamic-sampling True: with distillation alone every reward is weighted 0"),
    (["--temperature", "0"], "--temperature 0.0: use a positive number"),
    (["--top-p", "1.5"], "--top-p 1.5: use a number in (0, 1]"),
    (["--clip-low", "1"], "--clip-low 1.0: use a number in [0, 1)"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0: use 1 or more"),
    (["--dual-clip-c", "1"], "--dual-clip-c 1.0: use a bound above 1"),
    (["--overlong-buffer", "9"],
     "--overlong-buffer 9: use 0 (off) or a number of tokens up to --max-new-tokens (6)"),
    (["--mismatch-high", "0.5"], "--mismatch-high 0.5: use 1 or more"),
    (["--timeout-s", "0"], "--timeout-s 0.0: use a positive number of seconds"),
    (["--reward-weights", "1", "2"], "--reward-weights (1.0, 2.0): use one weight per --rewards term"),
    (["--resume", "/no/such/checkpoint"],
     "--resume /no/such/checkpoint: no complete checkpoint is at that path: use restart, auto, none or a "
     "complete"),
    (["--resume", "{tmp}"], "use restart, auto, none or a complete checkpoint"),
    (["--learning-rate", "1e-4"], "the flags do not parse (see above)"),
    (["--run-dir", "{tmp}/bad.jsonl"], "--run-dir"),
    (["--run-dir", "{tmp}/bad.jsonl/run"], "/run: cannot be created or written ({tmp}/bad.jsonl is a file)"),
    (["--run-dir", "/sys/rl-run"], "--run-dir /sys/rl-run: cannot be created or written (Operation not "
     "permitted in /sys); pass a directory you can write"),
    # a flag that only applies under another one (the whole table: test_a_flag_that_applies_...)
    (["--mismatch-level", "sequence"], "--mismatch-level sequence: it only applies to --mismatch"),
    (["--dual-clip-c", "5"], "--dual-clip-c 5.0: it only applies to --policy-loss dual_clip"),
    # combinations that cannot work
    (["--sync-bucket-mb", "8"], "it only applies to --placement disaggregate"),
    (["--max-staleness", "1"], "add --placement disaggregate --rollout-ranks K"),
    (["--rollout-ranks", "1"], "--rollout-ranks applies to --placement disaggregate only"),
    (["--prompts-per-step", "3"], "use a multiple such as [2, 4, 6]"),
    (["--minibatches", "3"], "--minibatches 3 does not split the 8 completions"),
    (["--answer-column", "None"], "--rewards accuracy compares each completion with the row's answer"),
    (["--rewards", "accuracy", "rm"], "--reward-model None: a reward model and the `rm` term of --rewards go "
     "together: give both, or neither"),
    (["--reward-model", "assets/arith-tiny"],
     "--reward-model assets/arith-tiny: a reward model and the `rm` term"),
    (["--rewards", "rm", "--reward-model", "assets/arith-tiny"],
     "--reward-model assets/arith-tiny is a Qwen2ForCausalLM: use a ...ForSequenceClassification checkpoint"),
    (["--rewards", "rm", "--reward-model", "{tmp}/rm_without_pad"], "config.json has no pad_token_id"),
    (["--dynamic-sampling", "--advantage", "remax"], "carry no signal only under a group baseline"),
    # --stream (roles/stream.py)
    (["--stream"], "--stream True: rollout ranks stream to trainers, and --placement colocate has none"),
    (["--placement", "disaggregate", "--rollout-ranks", "1", "--stream"],
     "--stream True: a token may then be sampled under an older version"),
    (["--placement", "disaggregate", "--rollout-ranks", "1", "--max-staleness", "1", "--stream",
      "--stream-rows", "3"], "--stream-rows 3: a prompt's 4 samples are admitted together"),
    (["--placement", "disaggregate", "--rollout-ranks", "1", "--max-staleness", "1", "--stream",
      "--dynamic-sampling"], "--stream-swap fixed: --dynamic-sampling decides each wave"),
    (["--stream-swap", "asap"], "--stream-swap asap"),
    (["--placement", "disaggregate", "--rollout-ranks", "1", "--max-staleness", "1", "--stream",
      "--engine", "vllm"], "--stream-swap fixed: a rollout rank's vLLM takes new weights inside trainer 0's"),
    (["--placement", "disaggregate", "--rollout-ranks", "1", "--max-staleness", "1", "--stream",
      "--engine", "vllm", "--stream-swap", "asap", "--lora-rank", "4", "--lora-vllm", "adapters"],
     "--stream True: vLLM's running requests keep the adapter they started with"),
    (["--placement", "partial", "--sampler-ranks", "1"],
     "--judge-model None: --placement partial splits the policy's ranks between a sampler and a judge: add a "
     "--judge-model"),
    (["--rewards", "judge"],
     "--judge-model None: a judge and the `judge` term of --rewards go together: give both, or neither"),
    (["--rewards", "accuracy", "judge", "--judge-model", "assets/judge-tiny",
      "--judge-template", "{prompt} {why}"],
     "--judge-template reads {why}, which is no field"),
    (["--rewards", "accuracy", "judge", "--judge-model", "assets/judge-tiny",
      "--judge-template", "prompts/judge_prompt.txt"],
     "--judge-template prompts/judge_prompt.txt: no such file"),
    # multi-turn episodes (engines/episodes.py), before the process group
    (["--tools", "nomodule:fn"], "--tools 'nomodule:fn' could not be loaded: ModuleNotFoundError"),
    (["--tools", "tasks.env:multiply"], "--env / --tools: the tokenizer in assets/arith-tiny has no chat "
     "template"),
    (["--env", "tasks.env:multiply"],
     "--env tasks.env:multiply is a function, not a class: pass a class with reset(row) and step(text)"),
    (["--tools", f"{__name__}:add_all"],  # this file's user functions (at its end)
     f"--tools {__name__}:add_all: *numbers takes any number of positional arguments"),
    (["--tools", "tasks.env:multiply", "--env", f"{__name__}:NeedsSeed"],
     f"--env {__name__}:NeedsSeed: NeedsSeed(seed) cannot be made with no arguments"),
    (["--tools", "tasks.env:multiply", "--max-turns", "0"], "--max-turns 0: use 1 or more"),
    (["--env", "tools"], "--env tools: name the tools with --tools"),
    # LoRA
    (["--lora-rank", "8", "--lora-targets", "q_proj,qkv"],
     "--lora-targets q_proj,qkv: ['qkv'] matches no linear"),
    (["--lora-rank", "8", "--lora-vllm", "adapters"], "--lora-vllm adapters: adapters is vLLM's mode (the "
     "native engine takes the base once and then the adapters alone already): use merged, or --engine vllm"),
    (["--lora-rank", "1000", "--lora-vllm", "adapters", "--engine", "vllm"],
     "--lora-rank 1000: vLLM serves adapters up to rank 512: use at most 512, or --lora-vllm merged"),
    # the model checkpoint, before the process group
    (["--model", "{tmp}/truncated"], "truncated/model.safetensors is not a readable safetensors file"),
    (["--model", "{tmp}/nothing"], "--model: checkpoint directory"),
    (["--model", "{tmp}/adapter"], "--model {tmp}/adapter is a LoRA adapter (adapter_config.json, no "
     "config.json), not a whole model: pass its base model (assets/arith-tiny, as its adapter_config.json "
     "says) as --model, with --lora-rank R to train adapters on it"),
    (["--model", "{tmp}/yarn"], "config.json: rope_scaling asks for rope_type 'yarn', which this trainer "
     "does not implement"),
    (["--model", "Qwen/Qwen3-0.6B"],
     "--model Qwen/Qwen3-0.6B: no such local directory, and downloading it from the Hugging Face hub "
     "failed (LocalEntryNotFoundError); without the network, pass a local checkpoint"),
    # data, after the process group
    (["--dataset", "{tmp}/bad.jsonl", "--eval-every", "0"], "bad.jsonl' line 2: not valid JSON"),
    (["--dataset", "{tmp}/int_prompt.jsonl", "--eval-every", "0"],
     "int_prompt.jsonl' row 1: column 'prompt'"),
    (["--dataset", "{tmp}/list_answer.jsonl", "--eval-every", "0"],
     "row 0: column 'answer' must be a string"),
    (["--dataset", "{tmp}/junk.parquet", "--eval-every", "0"],
     "junk.parquet' is not a readable parquet file"),
    (["--dataset", "{tmp}/missing.jsonl"], "dataset file '{tmp}/missing.jsonl' does not exist"),
    (["--dataset", "{tmp}/bad.jsonl", "--eval-every", "0", "--placement", "disaggregate",
      "--rollout-ranks", "1"],
     "bad.jsonl' line 2: not valid JSON"),  # on 3 ranks: the rollout rank leaves without a traceback
    # rewards, after the process group (the last two during the steps)
    (["--rewards", "nonsense"], "reward 'nonsense': use one of"),
    (["--rewards", f"{__name__}:score_answer"],
     f"--rewards {__name__}:score_answer takes no 'finish_reason', and the trainer passes every column by "
     "keyword (answer, finish_reason): add **columns to its parameters"),
    (["--rewards", "tests.helpers.rewards:words"],
     "returned ['good', 'good', 'good', 'good']...: it must return"),
    (["--rewards", "tests.helpers.rewards:wrong_length"], "returned 1 scores for 8 completions"),
    # only rank 1 meets it: rank 0, broken off in the step's collective, stays quiet
    (["--rewards", "tests.helpers.rewards:wrong_length_on_rank_1"], "(rank 1) reward function"),
    (["--rewards", "tests.helpers.rewards:always_fails", "--max-skipped-steps", "1"],
     "stopping: in 2 steps every reward failed (--max-skipped-steps 1); check --rewards "
     "tests.helpers.rewards:always_fails: tests.helpers.rewards:always_fails: RuntimeError: "
     "this reward always fails. No checkpoint was saved."),
]


VL = ["--model", "assets/vl-tiny", "--dataset", "builtin:squares"]
CASES += [  # a vision-language --model, and what only applies to one
    (["--freeze-vision"], "--freeze-vision: --model assets/arith-tiny is a text model (it takes no images)"),
    (["--image-column", "pic"], "--image-column pic: --model assets/arith-tiny is a text model"),
    ([*VL, "--tools", "tasks.env:multiply"], "--tools with a vision-language --model: it would read the "
     "prompts as text"),
    ([*VL, "--rewards", "accuracy", "judge", "--judge-model", "assets/judge-tiny"], "--judge-model with a "
     "vision-language --model"),
]


PPO_CASES = [  # train_ppo.py's own flags, and a shared check through its own check_args
    (["--value-clip", "0"], "--value-clip 0.0: use a positive number"),
    (["--lam", "1.5"], "--lam 1.5: use a number in [0, 1]"),
    (["--kl-target", "0.1", "--kl-coef", "0"], "--kl-target 0.1: it adapts --kl-coef, which is 0 (no KL "
     "term): give a --kl-coef above 0, or drop --kl-target"),
    (["--critic-model", "{tmp}/nothing"], "--critic-model: checkpoint directory"),
    (["--critic-model", "{tmp}/other_tokenizer"], "other_tokenizer has another tokenizer than --model "
     "assets/arith-tiny: the critic values the policy's token ids"),
    (["--kl-horizon", "100"], "--kl-horizon 100: it only applies to a --kl-target"),
    (["--teacher-model", "{tmp}/other_tokenizer"], "has another tokenizer than --model assets/arith-tiny"),
    (["--rewards", "rm", "--reward-model", "{tmp}/rm_without_pad"], "config.json has no pad_token_id"),
    (["--prompts-per-step", "3"], "use a multiple such as [2, 4, 6]"),
    (["--rewards", "judge"], "the generative judge (--judge-model) is train_grpo.py's"),
    (["--model", "assets/vl-tiny", "--dataset", "builtin:squares"],
     "is a vision-language model: PPO's critic"),
]
CASES = [("train_grpo.py", f, s) for f, s in CASES] + [("train_ppo.py", f, s) for f, s in PPO_CASES]
# Through torchrun, end to end: one of each kind met after the process group (a dataset that does
# not parse, on 2 and 3 ranks; reward functions that fail during the steps; the judge's template),
# the parse failure, and one of each kind met before it. The rest are checked in this process
# (`check_args`, then the prompts and the reward terms: what the scripts run in that order): the
# same message, without ~6 s of torchrun each.
END_TO_END = {"--lr -1", "--learning-rate 1e-4", "--max-staleness 1", "--model {tmp}/truncated",
              "--value-clip 0", "--run-dir /sys/rl-run"}
AFTER_GROUP = ("--dataset {tmp}/bad.jsonl", "--rewards tests.",
               "--rewards accuracy judge --judge-model")
LAUNCHED = [c for c in CASES if " ".join(c[1]) in END_TO_END or " ".join(c[1]).startswith(AFTER_GROUP)]
IN_PROCESS = [c for c in CASES if c not in LAUNCHED]


def case_id(case):
    script, flags, _ = case
    return f"{script[6:9]} {' '.join(flags)[:40]}"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_inputs")
    make_inputs(tmp)
    return tmp


def base_flags(script: str, flags: list[str]) -> list[str]:
    """The tiny run's flags a case adds its own to (a case with --eval-every 0: without --eval-prompts)."""
    base = TINY if script == "train_grpo.py" else PPO_TINY
    if "--eval-every" in flags and flags[flags.index("--eval-every") + 1] == "0":
        base = no_eval(base)[:-2]
    return base


def fill(flags, says, inputs):
    return [f.replace("{tmp}", str(inputs)) for f in flags], says.replace("{tmp}", str(inputs))


@pytest.mark.parametrize("script,flags,says", LAUNCHED, ids=map(case_id, LAUNCHED))
def test_a_mistake_ends_in_one_error_line(script, flags, says, inputs, tmp_path):
    flags, says = fill(flags, says, inputs)
    ranks = 3 if "disaggregate" in flags else 2
    # the first case under torchrun itself (what a user sees there), the rest on tests/launch.py's
    # forked ranks: what they print and how they exit is the scripts' own either way
    p = torchrun(ranks, script, *base_flags(script, flags), "--run-dir", str(tmp_path / "run"), *flags,
                 timeout=180, check=False, fresh=(script, flags) == tuple(LAUNCHED[0][:2]),
                 env={"HF_HUB_OFFLINE": "1"})  # tests never download
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-2000:]
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and says in lines[0], out[-3000:]
    assert not OUR_FRAME.search(out), out[-3000:]  # no traceback from the workers
    run = tmp_path / "run"  # nothing left behind: no checkpoint, no final model
    assert not (run / "checkpoints").exists() and not (run / "final").exists(), list(run.iterdir())


@pytest.mark.parametrize("script,flags,says", IN_PROCESS, ids=map(case_id, IN_PROCESS))
def test_a_mistake_before_the_process_group_says_what_to_change(script, flags, says, inputs, tmp_path,
                                                                monkeypatch):
    from models.hf import read_config
    from models.tokenizer import Tokenizer
    from roles.reward import Reward
    from run import load_prompts

    flags, says = fill(flags, says, inputs)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    train = importlib.import_module(script.removesuffix(".py"))
    args = tyro.cli(train.Args, args=[*base_flags(script, flags), "--run-dir", str(tmp_path / "run"), *flags])
    with pytest.raises(errors.UserError) as e:  # what the script runs before dist.init, in its order
        train.check_args(args, 3 if "disaggregate" in flags else 2)
        if script == "train_rm.py":
            read_config(args.model), Tokenizer(args.model)
        else:  # then, after the group, the prompts and the reward terms (launched: one of each kind)
            rows = load_prompts(args.data, Tokenizer(args.data.model), args.env)[0]
            args.reward.check_rows(rows)
            Reward(args.reward.rewards)
    assert says in str(e.value)


@pytest.mark.parametrize("debug", [False, True])
def test_a_user_error_is_one_line_and_a_bug_keeps_its_traceback(debug):
    env = {**os.environ, "RL_DEBUG": "1" if debug else "0"}
    run = partial(subprocess.run, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    pre = "from utils import errors; errors.install(); "
    user = run([sys.executable, "-c",
                pre + "raise errors.UserError('--lr -1: use a positive learning rate')"])
    bug = run([sys.executable, "-c", pre + "{}['missing']"])
    assert bug.returncode == 1 and "Traceback" in bug.stderr and "KeyError: 'missing'" in bug.stderr
    if debug:
        assert user.returncode == 1 and "Traceback" in user.stderr
    else:
        assert user.returncode == 2 and user.stderr == "error: --lr -1: use a positive learning rate\n"


@pytest.mark.reordered
def test_a_failed_sample_adds_nothing_to_the_loss_or_its_gradient():
    """Row 1's reward failed: its loss mask and advantage are 0. The loss equals the loss without
    that row and the gradient on its log-probs is exactly 0, KL term included."""
    from rl import algos
    from train_grpo import Args, loss_fn

    torch.manual_seed(0)
    N, T = 4, 5
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    scored = torch.tensor([[True, False, True, True]])
    adv = algos.group_advantages(rewards, scored=scored).view(-1, 1).expand(N, T)
    assert adv[1].eq(0).all()
    batch = {"loss_mask": torch.ones(N, T) * scored.view(-1, 1), "old_logp": -torch.rand(N, T), "adv": adv,
             "ref_logp": -torch.rand(N, T)}
    args = Args(kl_coef=0.1)
    logp = (-torch.rand(N, T)).requires_grad_()
    loss, _ = loss_fn(logp, batch, 15.0, args)
    loss.backward()
    assert torch.equal(logp.grad[1], torch.zeros(T)) and logp.grad[[0, 2, 3]].abs().sum() > 0
    keep = [0, 2, 3]
    rest = {k: v[keep] for k, v in batch.items()}
    loss_rest, _ = loss_fn(logp.detach()[keep], rest, 15.0, args)
    assert torch.allclose(loss.detach(), loss_rest, rtol=1e-6, atol=0)  # the same sum, in another order


def test_nan_rewards_are_failures_not_zeros():
    from roles.reward import Reward

    reward = Reward(["tests.helpers.rewards:nan_for_odd"])
    total, _, failed = reward.score(["p"] * 4, ["a1", "b2", "c3", "d4"], {})
    assert failed.tolist() == [True, False, True, False] and total.tolist() == [0.0, 1.0, 0.0, 1.0]


def test_user_error_is_a_value_error():
    assert issubclass(errors.UserError, ValueError)


def conditions(script) -> list[tuple[str, str]]:
    """(flag, the flag it applies under) for every flag of the script whose help begins with its
    condition: `--flag ...:` or a choice of another flag (`gspo: ...`), read from the Args."""
    from test_flags import flag_docs

    docs = flag_docs(importlib.import_module(script.removesuffix(".py")).Args)
    choices = {name: typing.get_args(t) for name, (t, _) in docs.items() if typing.get_origin(t) is Literal}
    table = []
    for name, (_, doc) in docs.items():
        head = doc.split(":")[0]
        if ":" not in doc or len(head) > 40:
            continue
        for word in re.split(r"[ ,]+", head):
            if word in choices.get(name, ()):
                continue  # the flag's own choices, described in its help
            parents = [p for p, c in choices.items() if word in c]
            if word.startswith("--") and word[2:].replace("-", "_") in docs:
                parents = [word[2:].replace("-", "_")]
            if parents:
                table.append((name, parents[0]))
                break
    return table


def another_value(value, kind):
    """A value of the flag's type other than its default, in a range its own check accepts."""
    if typing.get_origin(kind) is Literal:
        return next(c for c in typing.get_args(kind) if c != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 if value else 1
    if value is None:
        return "{prompt} {completion}" if "None" in str(kind) else None
    if isinstance(value, tuple):
        return (*value, 1, 2)
    return value + "-other"


TABLE = [(s, *c) for s in ("train_grpo.py", "train_ppo.py", "train_rm.py") for c in conditions(s)]


def test_the_table_of_flags_that_apply_under_another_is_read_from_their_help():
    grpo = {flag: parent for script, flag, parent in TABLE if script == "train_grpo.py"}
    assert grpo["mismatch_level"] == "mismatch" and grpo["dual_clip_c"] == "policy_loss"
    assert grpo["sync_bucket_mb"] == "placement" and grpo["judge_samples"] == "judge_model"
    assert "loss_agg" not in grpo and "lr" not in grpo  # a flag's own choices are no condition
    assert len(TABLE) >= 30, TABLE


@pytest.mark.parametrize("script,name,parent", TABLE, ids=[f"{s[6:9]} {n}" for s, n, _ in TABLE])
def test_a_flag_that_applies_under_another_is_refused_without_it(script, name, parent, monkeypatch):
    """Set away from its default while the flag it needs is off (its default, or else another value
    of its type), the flag is refused in one message naming it, before the process group."""
    from test_flags import flag_docs

    from utils.errors import default_of, flags_of

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    train = importlib.import_module(script.removesuffix(".py"))
    kinds = {n: t for n, (t, _) in flag_docs(train.Args).items()}
    said, keep = [], object()
    for off in [keep, *(typing.get_args(kinds[parent]) if typing.get_origin(kinds[parent]) is Literal else
                        (0, False, None))]:
        args = train.Args()
        owners = flags_of(args)
        setattr(owners[name], name, another_value(default_of(owners[name], name), kinds[name]))
        if off is not keep:
            setattr(owners[parent], parent, off)
        try:
            train.check_args(args, 2)
        except errors.UserError as e:
            said.append(str(e))
            if errors.flag(name) in str(e):
                return
    pytest.fail(f"{errors.flag(name)} off its condition ({errors.flag(parent)}) was not refused: {said}")


def test_mismatch_level_without_mismatch_says_what_to_add():
    from train_grpo import Args, check_args

    with pytest.raises(errors.UserError) as e:
        check_args(tyro.cli(Args, args=["--mismatch-level", "sequence"]), 2)
    assert str(e.value) == ("--mismatch-level sequence: it only applies to --mismatch tis, mis or icepop "
                            "(add that, or drop --mismatch-level)")


def test_a_path_that_is_not_there_is_not_taken_for_a_template():
    """--judge-template: a missing file is refused (it used to become every judge prompt); so is a
    template, from a file or not, that never shows the judge the completion."""
    from roles.judge import check_template, read_template

    for missing in ("prompts/judge_prompt.txt", "judge.jinja", "./templates/judge"):
        with pytest.raises(errors.UserError, match=f"--judge-template {re.escape(missing)}: no such file"):
            read_template(missing)
    assert read_template("Is {completion} right?") == "Is {completion} right?"
    with pytest.raises(errors.UserError, match=r"never reads \{completion\}"):
        check_template("Is {prompt} answered?", [])


MATH_KEYS = [  # (config.json keys this decoder does not implement, what the error names)
    ({"rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}},
     "rope_scaling asks for rope_type 'yarn'"),  # beside rope_parameters: Qwen2.5's model card
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
     "rope_parameters asks for rope_type 'linear'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling asks for rope_type 'dynamic'"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window = True"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types has 1 'sliding_attention'"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping = 50.0"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping = 30.0"),
    ({"logits_scaling": 8.0}, "logits_scaling = 8.0"),
    ({"embedding_multiplier": 12.0}, "embedding_multiplier = 12.0"),
    ({"residual_multiplier": 0.22}, "residual_multiplier = 0.22"),
    ({"attention_multiplier": 0.0078}, "attention_multiplier = 0.0078"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act = 'gelu_pytorch_tanh'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
    ({"mlp_bias": True}, "mlp_bias = True"),
    ({"attention_dropout": 0.1}, "attention_dropout = 0.1"),
    ({"some_future_scaling": 2.0}, "some_future_scaling = 2.0"),
]


@pytest.mark.parametrize("keys,says", MATH_KEYS, ids=[next(iter(k)) for k, _ in MATH_KEYS])
def test_a_config_key_that_changes_the_math_is_implemented_or_refused(keys, says):
    from models.config import ModelConfig

    config = json.loads(open(os.path.join(ROOT, "assets/arith-tiny/config.json")).read())
    ModelConfig.from_hf(config)  # the shipped model reads
    with pytest.raises(errors.UserError, match=re.escape(says)):
        ModelConfig.from_hf({**config, **keys})


def test_the_export_writes_back_every_key_it_read():
    """A Qwen2.5-style config with every math key at its neutral value, and Llama 3.2's llama3 RoPE
    in the older spelling: each key comes back in the exported config.json with its value."""
    from models.config import ModelConfig

    config = json.loads(open(os.path.join(ROOT, "assets/arith-tiny/config.json")).read())
    qwen25 = {**config, "rope_scaling": None, "sliding_window": 131072, "use_sliding_window": False,
              "max_window_layers": 21, "attention_dropout": 0.0, "hidden_act": "silu",
              "torch_dtype": "bfloat16",
              "layer_types": ["full_attention"] * config["num_hidden_layers"], "use_cache": True}
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    llama = {**config, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
             "mlp_bias": False, "rope_theta": 500000.0, "rope_scaling": llama3, "pretraining_tp": 1}
    llama.pop("rope_parameters", None)
    for source in (qwen25, llama):
        out = ModelConfig.from_hf(source).to_hf()
        assert set(source) <= set(out), set(source) - set(out)
        for key, value in source.items():
            if key not in ("rope_parameters", "rope_scaling") or value is None:
                assert out[key] == value, key
        again, first = ModelConfig.from_hf(out), ModelConfig.from_hf(source)
        assert dataclasses.replace(again, extra={}) == dataclasses.replace(first, extra={})  # the same model


def test_a_reward_function_that_returns_nothing_is_named():
    from roles.reward import Reward

    with pytest.raises(errors.UserError) as e:
        Reward(["tests.helpers.rewards:forgets_return"]).score(["p"] * 2, ["a", "b"], {})
    assert str(e.value) == ("reward function 'tests.helpers.rewards:forgets_return' returned None: it must "
                            "return one float per completion, a list of 2 here (is its `return` missing?)")


def test_a_missing_vllm_is_one_line_on_every_rank_before_the_process_group(monkeypatch):
    """--engine vllm without vLLM: said by check_args, which every rank runs before the group (it
    used to be said by the rollout rank while its trainers broke off in the transfer's set-up)."""
    import importlib.util

    from train_grpo import Args, check_args

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *_: None if name == "vllm" else real(name))
    args = tyro.cli(Args, args=[*TINY, "--engine", "vllm", "--placement", "disaggregate",
                                "--rollout-ranks", "1"])
    with pytest.raises(errors.UserError, match="--engine vllm needs vLLM. GPU: pip install -r requirements-"):
        check_args(args, 3)


# User-supplied callables, checked once before the run against what the trainer calls
# (utils/callables.py check_tool, check_env and check_reward): each mistake below is one line naming it.
def add_all(*numbers: int) -> int:
    """Add numbers (the issue's example: a tool call is a JSON object of named arguments)."""
    return sum(numbers)


def options(**flags: bool) -> str:
    """Any keyword."""
    return str(flags)


def untyped(a, b: int) -> int:
    """A parameter without a type."""
    return a + b


def pair(point: tuple[int, int]) -> int:
    """A type JSON schema has no word for."""
    return point[0]


def undocumented(a: int) -> int:
    return a


def keyword_only(a: int, *, scale: float = 1.0) -> float:
    """Keyword-only is fine: the worker passes every argument by name.

    Args:
        a: a number
        scale: its factor
    """
    return a * scale


lambda_tool = lambda a: a  # noqa: E731
partial_tool = partial(keyword_only, scale=2.0)


async def fetch(url: str) -> str:
    """Fetches a page."""
    return url


def count_up(n: int):
    """Yields its numbers."""
    yield from range(n)


def misdescribed(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        c: the second factor
    """
    return a * b


def positional(a: int, /) -> int:
    """Positional-only."""
    return a


def multiply(a: int, b: int) -> int:
    """Another tool named multiply."""
    return a * b


def forward_ref(p: "Point") -> int:  # noqa: F821
    """Its annotation names nothing."""
    return 0


class Game:
    """A working environment."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        return [], 0.0, True


class NeedsSeed(Game):
    def __init__(self, seed):
        self.seed = seed


class TwoArgStep(Game):
    def step(self, text, history):
        return [], 0.0, True


class NoReset:
    def step(self, text):
        return [], 0.0, True


class NamedTools(Game):
    tools = ["multiply"]


class UntypedTool(Game):
    tools = [untyped]


def make_game():
    return Game()


GAME = Game()


def score_answer(prompts, completions, answer):
    return [0.0] * len(completions)


def score_completions(completions, **columns):
    return [0.0] * len(completions)


def score_solution(prompts, completions, solution, **columns):
    return [0.0] * len(completions)


class Scorer:
    def __init__(self, prompts, completions, **columns):
        self.scores = [0.0] * len(completions)


async def score_remotely(prompts, completions, **columns):
    return [0.0] * len(completions)


def score_lazily(prompts, completions, **columns):
    yield from [0.0] * len(completions)


def score_image(prompts, images, answer):
    return [0.0] * len(images)


M = __name__
TOOL_MISTAKES = [  # (--tools, the error line)
    ((f"{M}:add_all",),
     f"--tools {M}:add_all: *numbers takes any number of positional arguments, which a tool call (a JSON "
     "object of named arguments) cannot pass: take one list instead (numbers: list[int])"),
    ((f"{M}:options",),
     f"--tools {M}:options: **flags takes any keyword, which its JSON schema cannot describe to the model: "
     "name each argument as a typed parameter"),
    ((f"{M}:untyped",), f"--tools {M}:untyped: its parameter a has no type annotation, which its JSON schema "
     "needs: annotate it (a: int, float, str, bool, list or dict)"),
    ((f"{M}:pair",),
     f"--tools {M}:pair: its parameter point: tuple[int, int] has no JSON schema type: use int, float, str, "
     "bool, list or dict (or one of them | None, with a default)"),
    ((f"{M}:undocumented",), f"--tools {M}:undocumented has no docstring: its first paragraph is the tool's "
     "description in the chat template, and `name: text` lines under Args: describe the parameters; add one"),
    # ten more of our own
    ((f"{M}:lambda_tool",), f"--tools {M}:lambda_tool is a lambda, whose name (<lambda>) the model cannot "
     "call: define it with def"),
    ((f"{M}:partial_tool",), f"--tools {M}:partial_tool is a partial, not a function: a tool is a plain def "
     "with typed parameters and a docstring (as tasks.env:multiply)"),
    ((f"{M}:fetch",), f"--tools {M}:fetch is async: the tool worker calls it plainly and would get a "
     "coroutine, not its result: make it a plain def"),
    ((f"{M}:count_up",), f"--tools {M}:count_up is a generator (it yields): the tool worker reads what "
     "it returns: return its result instead"),
    ((f"{M}:misdescribed",),
     f"--tools {M}:misdescribed: its docstring describes 'c' under Args:, which is no parameter of it (its "
     "parameters: a, b): describe the parameters it has"),
    ((f"{M}:positional",), f"--tools {M}:positional: its parameter a is positional-only (before /), and the "
     "tool worker passes every argument by name: drop the /"),
    (("tasks.env:multiply", f"{M}:multiply"), f"--tools tasks.env:multiply {M}:multiply: two tools are named "
     "multiply, and the model calls a tool by its name: rename one"),
    ((f"{M}:forward_ref",),
     f"--tools {M}:forward_ref: its annotations do not resolve (NameError: name 'Point' is not defined); "
     "annotate with int, float, str, bool, list or dict"),
    ((f"{M}:Game",), f"--tools {M}:Game is a class, not a function: a tool is a plain def with typed "
     "parameters and a docstring (as tasks.env:multiply)"),
]
ENV_MISTAKES = [  # (--env, the error line)
    (f"{M}:NeedsSeed",
     f"--env {M}:NeedsSeed: NeedsSeed(seed) cannot be made with no arguments, as the trainer makes each "
     "episode's instance: give its parameters defaults"),
    (f"{M}:TwoArgStep",
     f"--env {M}:TwoArgStep: TwoArgStep.step(text, history) cannot be called as step(text), with one "
     "argument: take text alone (others need defaults)"),
    (f"{M}:NoReset",
     f"--env {M}:NoReset: NoReset has no reset(row) method: an environment class has reset(row) -> messages "
     "and step(text) -> (messages, reward, done); add it (docs/tools.md)"),
    # ours
    (f"{M}:make_game", f"--env {M}:make_game is a function, not a class: pass a class with reset(row) and "
     "step(text), of which the trainer makes one instance per episode (docs/tools.md)"),
    (f"{M}:GAME", f"--env {M}:GAME is a Game, not a class: pass a class with reset(row) and step(text), of "
     "which the trainer makes one instance per episode (docs/tools.md)"),
    (f"{M}:NamedTools",
     f"--env {M}:NamedTools: NamedTools.tools holds 'multiply', not a function: it lists the tool functions "
     "themselves (tools = [multiply]), not their names"),
    (f"{M}:UntypedTool", f"--env {M}:UntypedTool: its tool untyped: its parameter a has no type annotation, "
     "which its JSON schema needs: annotate it (a: int, float, str, bool, list or dict)"),
]
REWARD_MISTAKES = [  # (--rewards, the error line), the built-in task's columns: answer, finish_reason
    (f"{M}:score_answer",
     f"--rewards {M}:score_answer takes no 'finish_reason', and the trainer passes every column by keyword "
     "(answer, finish_reason): add **columns to its parameters"),
    # ours
    (f"{M}:score_completions",
     f"--rewards {M}:score_completions(completions, **columns) cannot take prompts and completions as its "
     "first two arguments: the trainer calls fn(prompts, completions, **columns); make its parameters "
     "(prompts, completions, **columns)"),
    (f"{M}:score_solution", f"--rewards {M}:score_solution: its parameter 'solution' is no column of the "
     "dataset (the trainer passes each column by keyword: answer, finish_reason); give it a default, or add "
     "the column"),
    (f"{M}:Scorer", f"--rewards {M}:Scorer is a class, not a function: the trainer calls fn(prompts, "
     "completions, **columns) and reads the list of scores it returns; pass a function"),
    (f"{M}:score_remotely", f"--rewards {M}:score_remotely is async: the trainer calls it plainly and would "
     "get a coroutine, not the list of scores: make it a plain def"),
    (f"{M}:score_lazily", f"--rewards {M}:score_lazily is a generator (it yields): the trainer reads what it "
     "returns: return the list of scores instead"),
    (f"{M}:M", f"--rewards {M}:M is a str, not a function: the trainer calls fn(prompts, completions, "
     "**columns) and reads the list of scores it returns; pass a function"),
]


@pytest.mark.parametrize("tools,says", TOOL_MISTAKES, ids=[t[-1].split(":")[-1] for t, _ in TOOL_MISTAKES])
def test_a_tool_the_trainer_cannot_describe_or_call_is_refused_before_the_run(tools, says):
    from engines.episodes import EnvArgs

    with pytest.raises(errors.UserError) as e:
        EnvArgs(tools=tools).check()
    assert str(e.value) == says


@pytest.mark.parametrize("env,says", ENV_MISTAKES, ids=[e.split(":")[-1] for e, _ in ENV_MISTAKES])
def test_an_environment_the_trainer_cannot_make_or_call_is_refused_before_the_run(env, says):
    from engines.episodes import EnvArgs

    with pytest.raises(errors.UserError) as e:
        EnvArgs(env=env).check()
    assert str(e.value) == says


@pytest.mark.parametrize("name,says", REWARD_MISTAKES, ids=[n.split(":")[-1] for n, _ in REWARD_MISTAKES])
def test_a_reward_function_the_trainer_cannot_call_is_refused_before_the_steps(name, says):
    from roles.reward import RewardArgs
    from tasks.data import multiply_rows

    rows = [{**r, "ids": [1, 2], "text": r["prompt"]} for r in multiply_rows("train")[:2]]
    with pytest.raises(errors.UserError) as e:
        RewardArgs(rewards=(name,)).check_rows(rows)
    assert str(e.value) == says


def test_what_the_trainer_can_call_passes_its_check():
    """Keyword-only and `X | None` parameters, a staticmethod reset, **columns: all fine."""
    from engines.episodes import EnvArgs
    from roles.reward import RewardArgs
    from tasks.env import schema

    EnvArgs(tools=("tasks.env:multiply", f"{M}:keyword_only")).check()
    EnvArgs(env=f"{M}:Game").check()
    EnvArgs(env="tasks.env:Retry").check()
    rows = [{"prompt": "1+1=", "answer": "2", "ids": [1], "text": "1+1="}]
    RewardArgs(rewards=("accuracy", "tests.helpers.rewards:length_bonus")).check_rows(rows)
    assert schema(keyword_only)["function"]["parameters"]["properties"]["scale"]["type"] == "number"


def test_a_flow_reward_function_is_checked_against_fn_prompts_images():
    import train_flow_grpo

    args = tyro.cli(train_flow_grpo.Args, args=["--rewards", "colour", f"{M}:score_image"])
    with pytest.raises(errors.UserError) as e:
        train_flow_grpo.check_args(args, 2)
    said = (f"--rewards {M}:score_image: its parameter 'answer' would get no value, as the trainer calls "
            "fn(prompts, images): give it a default, or drop it")
    assert str(e.value) == said


def test_a_checkpoint_without_config_json_is_named_by_its_flag_and_an_adapter_says_how_to_use_it(tmp_path):
    """The flag given, not --model; a LoRA adapter directory (what --lora-rank exports) says what it is."""
    from models.hf import checked_model
    from roles import judge, reward_model

    write_peft(str(tmp_path / "adapter"), {}, 8, 16.0)  # no base recorded
    (tmp_path / "empty").mkdir()
    checks = {"--teacher-model": partial(checked_model, flag="--teacher-model"),
              "--critic-model": partial(checked_model, flag="--critic-model", tokenizer=False),
              "--reward-model": partial(reward_model.check, policy="assets/arith-tiny"),
              "--judge-model": partial(judge.check, template=None)}
    for flag, check in checks.items():
        with pytest.raises(errors.UserError) as e:
            check(str(tmp_path / "adapter"))
        assert str(e.value) == (f"{flag} {tmp_path}/adapter is a LoRA adapter (adapter_config.json, no "
                                f"config.json), not a whole model: merge it into its base model (peft's "
                                f"merge_and_unload, then save_pretrained; a --lora-rank run writes that "
                                f"itself with --merge-on-export) and pass that directory as {flag}")
        with pytest.raises(errors.UserError) as e:
            check(str(tmp_path / "empty"))
        assert str(e.value) == (f"{flag} {tmp_path}/empty has no config.json: point {flag} at a Hugging Face "
                                f"checkpoint directory (config.json, *.safetensors, tokenizer.json)")


def rule_tables() -> list[tuple[str, str, str]]:
    """(where, flag, what the rule says after "--flag VALUE: ") for every rule of every
    `check_rules(cfg, [...])` call in the repository's code, read from its source (an f-string's
    fields as {...}): no copy of the messages here, and a table added later is read too."""
    import ast

    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "__pycache__")]
        for file in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, file)
            for node in ast.walk(ast.parse(open(path).read())):
                name = getattr(node, "func", None)
                if getattr(name, "id", getattr(name, "attr", None)) != "check_rules":
                    continue
                table = node.args[1]
                assert isinstance(table, ast.List), f"{path}:{node.lineno}: a rules table not written out"
                for rule in table.elts:
                    flag, _, says = rule.elts
                    found.append((f"{os.path.relpath(path, ROOT)}:{rule.lineno}", errors.flag(flag.value),
                                  source_text(says)))
    return found


def source_text(node) -> str:
    import ast

    if isinstance(node, ast.Constant):
        return node.value
    return "".join(v.value if isinstance(v, ast.Constant) else "{...}" for v in node.values)  # an f-string


REMEDY = re.compile(r"(^|: |; |, |\(|or )(use|add|drop|give|launch|pass|point|rename|leave)\b")
# "use" followed by a clause (a verb of its own) is the old format gone wrong: "use it moves ranks ..."
USE_CLAUSE = re.compile(r"\buse (.*?)(?=[:;(]|$)")
VERB = re.compile(r"\b(it|is|are|has|have|moves|keeps|decides|drops|restarts|forces|adapts|splits|runs|takes"
                  r"|reads|serves|carries|needs)\b")


def reads_wrong(says: str) -> str | None:
    """Why a rule's text does not read as the rest of a sentence that says what to do, or None."""
    if not REMEDY.search(says):
        return "says nothing to do (use, add, drop, give, launch, pass, ...)"
    for clause in USE_CLAUSE.findall(says):
        if clause.startswith("use") or VERB.search(clause):
            return f"'use {clause}' is no phrase that follows 'use'"
    if says[:1].isupper() or says.rstrip()[-1:] in ":;,":
        return "is not the rest of a sentence after '--flag VALUE: '"
    return None


def test_every_rule_reads_as_a_sentence_that_says_what_to_do():
    """check_rules says "--flag VALUE: <the rule's text>": each text says what is wrong and what to
    do. The old format ("use " + a text) made "--rebalance True: use it moves ranks between roles"."""
    tables = rule_tables()
    # a floor that says the tables were found (GRPO's and PPO's shared rows are one table in run.py)
    assert len({where.split(":")[0] for where, _, _ in tables}) >= 14 and len(tables) >= 110, len(tables)
    wrong = [(where, f"{flag} VALUE: {says}", why) for where, flag, says in tables
             if (why := reads_wrong(says))]
    assert not wrong, "\n".join(map(str, wrong))
    for old in ("use it moves ranks between roles: add --placement disaggregate",  # the three
                "use a move restarts the workers in the new layout: launch with torchrun --max-restarts N",
                "use it decides each refill from the last wave's rewards, so it runs on-policy: drop it",
                "1 or more", "use use 1 or more"):
        assert reads_wrong(old), old
