"""Multi-turn episodes (engines/episodes.py) and tools (tasks/env.py), in process: the template
delta against the whole chat, budgets, tool errors, the loss mask, and the engine's log-probs
against the trainer's across turns."""
import json
import os

import pytest
import torch

from assets.make import TOOL_TEMPLATE, tool_call_text, tool_tokenizer
from engines.base import Samples
from engines.decode import SamplingParams
from engines.episodes import EnvArgs, Episodes, check_template, metrics, sums, tokenize
from engines.native import NativeEngine
from models.tokenizer import Tokenizer
from tasks.data import make_batch, multiply_rows, per_sample
from tasks.env import ToolEnv, ToolWorker, multiply, parse_tool_calls, schema
from utils.errors import UserError

# Written after Qwen2.5's chat template (tools in a system block, tool replies grouped in a user
# turn as <tool_response>s, each turn closed by <|im_end|> and a newline the model never emits)
QWEN25_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou are a helpful assistant.\\n\\n# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# a template that rewrites earlier turns (as Qwen3 drops earlier <think> blocks)
REWRITES = ("{%- for m in messages %}"
            "{%- if m.role == 'assistant' and not loop.last %}{{ '<a>[earlier]' + eos_token }}"
            "{%- elif m.role == 'assistant' %}{{ '<a>' + m.content + eos_token }}"
            "{%- else %}{{ '<u>' + m.content }}"
            "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<a>' }}{%- endif %}")


def tokenizer(path, template=TOOL_TEMPLATE, eos=None) -> Tokenizer:
    tool_tokenizer(str(path))
    conf_file = os.path.join(path, "tokenizer_config.json")
    with open(conf_file) as f:
        conf = json.load(f)
    conf["chat_template"] = template
    if eos:  # Qwen's end of turn is its EOS
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HF

        hf = HF.from_file(os.path.join(path, "tokenizer.json"))
        hf.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", eos)])
        hf.save(os.path.join(path, "tokenizer.json"))
        conf["eos_token"] = eos
    with open(conf_file, "w") as f:
        json.dump(conf, f)
    return Tokenizer(str(path))


class Scripted:
    """An engine whose turns are texts: `turns(prompt text, turn index) -> text`, EOS appended;
    log-prob -0.5 a token; cut to max_new_tokens ("length")."""
    version = 3

    def __init__(self, tok, turns):
        self.tok, self.turns, self.calls = tok, turns, []

    def generate(self, prompts, params, seeds):
        self.calls.append(len(prompts) * params.n)
        rows = []
        for p in prompts:
            text = self.tok.tok.decode(p, skip_special_tokens=False)
            for _ in range(params.n):
                ids = self.tok.encode(self.turns(text, text.count("<|assistant|>") - 1), special=False)
                ids = ids + [min(self.tok.eos_ids)]
                rows.append((ids[:params.max_new_tokens], len(ids) > params.max_new_tokens))
        T = max(1, max(len(r) for r, _ in rows))
        tokens = torch.zeros(len(rows), T, dtype=torch.long)
        for i, (r, _) in enumerate(rows):
            tokens[i, :len(r)] = torch.tensor(r)
        lengths = torch.tensor([len(r) for r, _ in rows])
        logp = -0.5 * (torch.arange(T)[None] < lengths[:, None]).float()
        reasons = ["length" if cut else "stop" for _, cut in rows]
        return Samples(tokens, logp, lengths, reasons, [""] * len(rows), self.version)

    def close(self):
        pass


def episodes(tok, turns, tools=("tasks.env:multiply",), rows=None, max_new_tokens=200, **flags):
    cfg = EnvArgs(tools=tools, **flags)
    cfg.check()
    rows = rows or multiply_rows("eval")[:2]
    rows = tokenize(rows, tok, cfg, 1024)[0]
    return Episodes(Scripted(tok, turns), cfg, tok, rows, max_new_tokens), rows


def call_then_answer(text, turn):
    """Turn 0 calls multiply on the prompt's numbers; turn 1 copies the tool's result."""
    if turn == 0:
        a, b = text.split("<|user|>")[1].split("=")[0].split("*")
        return tool_call_text(a, b)
    return text.split("<tool_response>")[-1].split("</tool_response>")[0]


@pytest.mark.parametrize("template", ["tiny", "qwen2.5-style"])
def test_an_episode_rendered_turn_by_turn_is_the_whole_chat_rendered_at_once(tmp_path, template):
    """The episode's ids, decoded, are the template's render of the whole chat up to the model's
    last token; what the template puts after it is only the boundary the model never emits."""
    qwen = template != "tiny"
    tok = tokenizer(tmp_path, QWEN25_STYLE if qwen else TOOL_TEMPLATE, "<|im_end|>" if qwen else None)
    if qwen:
        def turns(text, turn):
            if "<tool_response>" not in text:
                a, b = text.split("user\n")[-1].split("=")[0].split("*")
                return tool_call_text(a, b)
            return text.split("<tool_response>\n")[-1].split("\n</tool_response>")[0]
    else:
        turns = call_then_answer
    eps, rows = episodes(tok, turns)
    out = eps.generate([r["ids"] for r in rows], SamplingParams(n=2, max_new_tokens=64), [1, 2])
    assert out.finish_reasons == ["stop"] * 4 and out.episode["turns"].tolist() == [2.0] * 4
    for i, r in enumerate(rows):
        a, b = r["prompt"].rstrip("=").split("*")
        chat = [{"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": tool_call_text(a, b)},
                {"role": "tool", "name": "multiply", "content": str(int(a) * int(b))},
                {"role": "assistant", "content": r["answer"]}]
        whole = tok.chat(chat, False, eps.tools)
        L = int(out.lengths[2 * i])
        ids = r["ids"] + out.tokens[2 * i, :L].tolist()
        text = tok.tok.decode(ids, skip_special_tokens=False)
        assert whole.startswith(text) and whole[len(text):] == "\n", (whole, text)
        assert out.texts[2 * i] == r["answer"]
        # the boundary "\n" after the model's end of turn is in the episode, outside the loss
        mask = out.model_mask[2 * i, :L].tolist()
        first_env = mask.index(0.0)
        assert tok.tok.decode(out.tokens[2 * i, first_env:first_env + 1].tolist()) == "\n"
        assert 0 < sum(mask) < L and mask[-1] == 1.0
        # each token's policy version: the engine's (3) on the model's, -1 on the environment's
        versions = out.token_versions[2 * i, :L].tolist()
        assert versions == [3 if m else -1 for m in mask] and out.version == 3


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    tok = tokenizer(tmp_path, REWRITES)
    with pytest.raises(UserError, match="rewrites earlier turns"):
        check_template(tok, [schema(multiply)])


def test_the_tool_schema_comes_from_the_signature_and_docstring():
    s = schema(multiply)["function"]
    assert s["name"] == "multiply" and s["description"] == "Multiply two integers."
    assert s["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first factor"}
    assert s["parameters"]["required"] == ["a", "b"]


def test_tool_calls_are_parsed_and_bad_ones_named():
    calls = parse_tool_calls('x <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> '
                             '<tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}</tool_call>'
                             '<tool_call>{"name": </tool_call><tool_call>[1]</tool_call>'
                             '<tool_call>{"name": "h"')
    assert calls[0] == ("f", {"a": 1}, None) and calls[1] == ("g", {"b": 2}, None)
    assert "not valid JSON" in calls[2][2] and '{"name"' in calls[3][2] and "closing" in calls[4][2]


def test_every_bad_tool_call_is_an_error_message_and_a_count_never_a_hang_or_a_crash():
    worker = ToolWorker(tuple(f"tests.helpers.tools_for_tests:{f}" for f in (
        "add", "boom", "hang", "shout", "huge", "thing", "die", "hog")), timeout_s=2.0, memory_mb=256)
    env = ToolEnv(worker)
    try:
        def ask(call):
            return env.step(f"<tool_call>{json.dumps(call)}</tool_call>")[0][0]["content"]

        assert ask({"name": "add", "arguments": {"a": 2, "b": 3}}) == "5"
        said = {
            "bad_json": env.step("<tool_call>{oops</tool_call>")[0][0]["content"],
            "unknown_tool": ask({"name": "nope", "arguments": {}}),
            "bad_arguments": ask({"name": "add", "arguments": {"a": 1, "c": 2}}),
            "raised": ask({"name": "boom", "arguments": {"x": 1}}),
            "timeout": ask({"name": "hang", "arguments": {"x": 1}}),
            "non_text": ask({"name": "thing", "arguments": {"x": 1}}),
            "crashed": ask({"name": "die", "arguments": {"x": 1}})}
        assert ask({"name": "shout", "arguments": {"x": 1}}) == "ok"  # its prints went nowhere
        hogged = ask({"name": "hog", "arguments": {"x": 1}})
        long = ask({"name": "huge", "arguments": {"x": 1}})
        assert ask({"name": "add", "arguments": {"a": 1, "b": 1}}) == "2"  # the worker lives on (restarted)
    finally:
        worker.close()
    for kind, text in said.items():
        assert text.startswith("error: "), (kind, text)
    assert "no good" in said["raised"] and "2 s" in said["timeout"] and "crashed" in said["crashed"]
    assert "MemoryError" in hogged and len(long) == 100_000
    assert env.errors == {**{k: 1 for k in said}, "raised": 2, "too_long": 1}
    assert env.calls == 12


def test_budgets_cut_where_they_say(tmp_path):
    tok = tokenizer(tmp_path)
    always_call = lambda text, turn: tool_call_text("12", "34")  # noqa: E731
    eps, rows = episodes(tok, always_call, max_turns=3)
    out = eps.generate([rows[0]["ids"]], SamplingParams(n=1, max_new_tokens=64), [0])
    assert out.finish_reasons == ["max_turns"] and out.episode["turns"].tolist() == [3.0]
    assert out.episode["tool_calls"].tolist() == [3.0]  # the environment sees every turn, the last too
    assert out.model_mask[0].sum() == 3 * len(tok.encode(tool_call_text("12", "34"), special=False)) + 3

    eps, rows = episodes(tok, always_call, max_turn_tokens=5)
    out = eps.generate([rows[0]["ids"]], SamplingParams(n=1, max_new_tokens=64), [0])
    assert out.finish_reasons == ["length"] and out.lengths.tolist() == [5]

    calls = len(tok.encode(tool_call_text("12", "34"), special=False)) + 1
    eps, rows = episodes(tok, always_call, max_new_tokens=calls + 3)  # the tool's reply does not fit
    out = eps.generate([rows[0]["ids"]], SamplingParams(n=1, max_new_tokens=64), [0])
    assert out.finish_reasons == ["length"] and out.lengths.tolist() == [calls]



def test_the_tool_reply_is_cut_to_max_tool_tokens(tmp_path):
    tok = tokenizer(tmp_path)
    call = '<tool_call>{"name": "huge", "arguments": {"x": 1}}</tool_call>'
    turns = lambda text, turn: call if turn == 0 else "7"  # noqa: E731
    eps, rows = episodes(tok, turns, tools=("tests.helpers.tools_for_tests:huge",), max_tool_tokens=4)
    try:
        out = eps.generate([rows[0]["ids"]], SamplingParams(n=1, max_new_tokens=200), [0])
    finally:
        eps.close()
    assert out.finish_reasons == ["stop"]
    assert out.episode["tool_error/too_long"].tolist() == [2.0]  # cut in the worker, then to 4 tokens
    text = tok.tok.decode(out.tokens[0, :int(out.lengths[0])].tolist())
    assert "7777 ...(cut)" in text and "77777" not in text
    total = sums(out)
    assert metrics(total)["episode/tool_error/too_long"] == 2
    assert metrics(total)["episode/tool_call_rate"] == 1


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """A random decoder of the tiny shape with the tool user's tokenizer, and some multi-turn
    episodes sampled from it, half of them made to call the tool (the first turn's text forced)."""
    from assets.make import TINY
    from models.config import ModelConfig
    from models.hf import build, save_model

    path = tmp_path_factory.mktemp("tool-model")
    eos = tool_tokenizer(str(path))
    cfg = ModelConfig(**TINY, architecture="Qwen2ForCausalLM", eos_token_id=eos, attention_bias=True)
    model = build(cfg)
    model.init_weights(0)
    save_model(model, cfg, str(path))
    return str(path), cfg


@pytest.mark.reordered
def test_env_tokens_get_no_gradient_and_engine_logprobs_match_the_trainers_across_turns(tool_model):
    """Native engine episodes (a first turn that calls the tool, then a sampled one): the trainer's
    log-probs of every model token equal the engine's within 1e-5, turn 2 included; the loss's
    gradient with respect to the log-prob of every environment token is exactly 0, and junk in
    their old log-probs and advantages changes nothing."""
    from models.decoder import completion_logprobs
    from models.hf import iter_checkpoint, load_model
    from train_grpo import Args, loss_fn

    path, cfg = tool_model
    tok = Tokenizer(path)
    engine = NativeEngine(cfg, tok)
    engine.load_weights(iter_checkpoint(path))

    class FirstTurnCalls:  # turn 0: the engine's sample replaced by a tool call (log-probs recomputed below)
        version = 0

        def generate(self, prompts, params, seeds):
            if params.n > 1:
                return Samples.cat([call_turn(tok, p, params.n) for p in prompts])
            return engine.generate(prompts, params, seeds)

    cfg_env = EnvArgs(tools=("tasks.env:multiply",), max_turn_tokens=12)
    cfg_env.check()
    rows = tokenize(multiply_rows("eval")[:2], tok, cfg_env, 256)[0]
    eps = Episodes(FirstTurnCalls(), cfg_env, tok, rows, 120)
    out = eps.generate([r["ids"] for r in rows], SamplingParams(n=2, max_new_tokens=120), [5, 6])
    eps.worker.close()
    assert (out.episode["turns"] == 2).all() and out.episode["tool_calls"].sum() == 4
    batch = make_batch(per_sample([r["ids"] for r in rows], 2), out.tokens, out.lengths, tok.pad_id,
                       model_mask=out.model_mask)
    model = load_model(path).eval()
    with torch.no_grad():
        logp = completion_logprobs(model, batch, 1.0)  # [N, T]
    sampled = batch["loss_mask"] > 0
    second = torch.zeros_like(sampled)
    for i in range(len(sampled)):
        env = (batch["loss_mask"][i] == 0).nonzero()[:, 0]
        second[i, int(env[0]):] = sampled[i, int(env[0]):]
    assert second.sum() > 0
    gap = (logp - out.logprobs).abs()[second]
    assert gap.max() < 1e-5, gap.max()

    args = Args()
    batch["old_logp"] = torch.where(batch["loss_mask"] > 0, logp, out.logprobs)
    batch["adv"] = torch.randn(len(sampled), 1).expand_as(logp).clone()
    x = logp.clone().requires_grad_(True)
    loss, _ = loss_fn(x, batch, float(batch["loss_mask"].sum()), args)
    loss.backward()
    env_tokens = (batch["loss_mask"] == 0) & (torch.arange(logp.shape[1])[None] < out.lengths[:, None])
    assert env_tokens.sum() > 0 and (x.grad[env_tokens] == 0).all() and (x.grad[second] != 0).any()
    junk = dict(batch, old_logp=torch.where(env_tokens, torch.randn_like(logp), batch["old_logp"]),
                adv=torch.where(env_tokens, torch.randn_like(logp) * 100, batch["adv"]))
    y = logp.clone().requires_grad_(True)
    loss_fn(y, junk, float(batch["loss_mask"].sum()), args)[0].backward()
    assert torch.equal(x.grad, y.grad)


@pytest.mark.reordered
def test_turns_prefilled_after_the_kept_cache_are_the_turns_prefilled_whole(monkeypatch):
    """assets/tool-tiny (it calls the tool on ~1 sample in 5) plays sampled episodes of
    builtin:multiply with the tool run for real, each turn prefilled after the KV cache the engine
    kept from the turn before (Episodes sets keep_prefixes), and again with every turn prefilled
    whole: the same episodes, token for token, and log-probs within 1e-5 (the kept keys were made
    by the decode step: the same math in another order, tests/test_rollout.py)."""
    from engines.decode import KeptPrefixes
    from models.hf import iter_checkpoint, read_config

    model = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tool-tiny")
    tok = Tokenizer(model)
    cfg = EnvArgs(tools=("tasks.env:multiply",))
    cfg.check()
    rows = tokenize(multiply_rows("eval")[:8], tok, cfg, 32)[0]
    seeds = list(range(len(rows)))
    filled, fill = [], KeptPrefixes.fill  # per request after the first: (columns prefilled, prompts' width)
    monkeypatch.setattr(KeptPrefixes, "fill",
                        lambda self, p, c: filled.append((fill(self, p, c), c.k.shape[3])) or filled[-1][0])
    outs = []
    for keep in (True, False):
        engine = NativeEngine(read_config(model), tok)
        engine.load_weights(iter_checkpoint(model))
        eps = Episodes(engine, cfg, tok, rows, 96)
        engine.keep_prefixes = keep
        outs.append(eps.generate([r["ids"] for r in rows], SamplingParams(n=4, max_new_tokens=96), seeds))
        eps.close()
    a, b = outs
    assert (a.episode["turns"] >= 2).sum() >= 4, a.episode["turns"]  # episodes that went on after a reply
    assert filled and all(s < width for s, width in filled), filled
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.model_mask, b.model_mask)
    assert (a.logprobs - b.logprobs).abs().max() < 1e-5


def call_turn(tok, prompt, n):
    """n copies of a first turn that calls multiply on the prompt's numbers (log-probs 0: not compared)."""
    a, b = tok.tok.decode(prompt, skip_special_tokens=True).split("\n")[1].rstrip("=").split("*")
    ids = tok.encode(tool_call_text(a, b), special=False) + [min(tok.eos_ids)]
    ids = torch.tensor([ids] * n)
    return Samples(ids, torch.zeros(ids.shape), torch.full((n,), ids.shape[1]), ["stop"] * n, [""] * n, 0)


class Broken:
    """An environment whose step returns the wrong shape."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        return "done"


class Slow(Broken):
    def step(self, text):
        import time

        time.sleep(30)


def test_an_environment_that_breaks_its_contract_is_named_one_that_hangs_ends_its_episode(tmp_path):
    tok = tokenizer(tmp_path)
    eps, rows = episodes(tok, lambda text, turn: "1", tools=(), env=f"{__name__}:Broken")
    with pytest.raises(UserError, match=r"Broken: step\(text\) returned 'done'; it returns \(a list"):
        eps.generate([rows[0]["ids"]], SamplingParams(n=1, max_new_tokens=8), [0])
    eps, rows = episodes(tok, lambda text, turn: "1", tools=(), env=f"{__name__}:Slow", env_timeout_s=0.5)
    out = eps.generate([rows[0]["ids"]], SamplingParams(n=2, max_new_tokens=8), [0])
    assert out.finish_reasons == ["env_error"] * 2 and out.episode["stop/env_error"].tolist() == [1.0, 1.0]


class CallsItself:
    """An --env that runs a tool itself on every turn but the last, counting in `calls` (the
    documented attribute: docs/tools.md) and its failures in `errors`."""

    def reset(self, row):
        self.calls, self.errors = 0, {"raised": 0}
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        if text.strip() == "7":
            return [], 1.0, True
        self.calls += 1
        self.errors["raised"] += 1
        return [{"role": "user", "content": "tool says 7"}], 0.0, False


class ListsItsCalls(CallsItself):
    """`calls` as the list of the calls; `errors` of its own kind (a list): counted 0, no crash."""

    def reset(self, row):
        messages = super().reset(row)
        self.calls, self.errors = [], ["not a count"]
        return messages

    def step(self, text):
        if text.strip() != "7":
            self.calls.append(("multiply", {"a": 1, "b": 7}))
        return ([], 1.0, True) if text.strip() == "7" else ([{"role": "user", "content": "7"}], 0.0, False)


@pytest.mark.parametrize("env", ["CallsItself", "ListsItsCalls"])
def test_an_env_that_calls_tools_itself_counts_its_calls(tmp_path, env):
    """episode/tool_calls reads the environment's `calls` (an int, or a list of the calls): an --env
    that runs its tools itself no longer reports 0."""
    tok = tokenizer(tmp_path)
    turns = lambda text, turn: "7" if turn == 2 else "again"  # noqa: E731
    eps, rows = episodes(tok, turns, tools=(), env=f"{__name__}:{env}")
    out = eps.generate([rows[0]["ids"]], SamplingParams(n=2, max_new_tokens=64), [0])
    assert out.finish_reasons == ["stop", "stop"] and out.episode["tool_calls"].tolist() == [2.0, 2.0]
    raised = [2.0, 2.0] if env == "CallsItself" else [0.0, 0.0]
    assert out.episode["tool_error/raised"].tolist() == raised
    assert metrics(sums(out))["episode/tool_call_rate"] == 1
