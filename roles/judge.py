"""The judge role: a generative reward model (an LLM judge), in this process or on ranks of its own.

G-Core (Wu et al. 2025, arXiv:2507.22789) scores a completion with a second LLM prompted as a
math teacher: the prompt shows the problem and the student's answer and ends with
"Verification: Is the answer correct (Yes/No)?"; the judge's reply is its verdict. The verdict
is parsed (`parse_verdict`): yes +1, no -1, a reply that says neither 0 (unparsed, counted).
Each completion is judged k times (k samples of the judge, temperature > 0) and its score is
the mean of the k verdicts, in [-1, 1]: G-Core's script uses k = 8 at temperature 0.7.

The judge is a generation engine (engines/native.py) with weights of its own. Colocated with
training, it loads before judging and releases after (as the policy's engine does), keeping
a CPU copy of its weights. A failure (generate raising, or a call past `timeout_s`) makes the
scores of that call NaN: the trainer counts them in reward/failures; it never stops silently.
`python -m assets.make --judge` builds assets/judge-tiny, a tiny judge of the built-in task.

With --placement partial the judge ranks judge the chunks their samplers stream to them
(rollouts.py `Streamed`, both halves).
"""
import math
import os
import random
import re
import string
from dataclasses import dataclass
from typing import ClassVar

import torch

from engines.decode import SamplingParams
from engines.make import make_engine
from models.hf import check_checkpoint, check_model_dir, iter_checkpoint, local_dir, read_config
from models.tokenizer import Tokenizer
from tasks.data import dataset_columns, per_sample
from utils.errors import UserError, check_rules
from utils.sandbox import TimeLimit, time_limit

MARKER = "Is the answer correct (Yes/No)?"
# what assets/judge-tiny was trained on (assets.make.judge_checkpoint); a completion comes after
# "Answer:" as the policy wrote it
DEFAULT_TEMPLATE = ("You are a math teacher. Grade the answer.\nProblem: {prompt}\nAnswer: {completion}\n"
                    "Verification: " + MARKER)

STRICT = re.compile(r"(yes|no)[.!]?", re.IGNORECASE)
WORD = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
CHOICE = re.compile(r"yes\s*/\s*no", re.IGNORECASE)  # "(Yes/No)" restated is no verdict


@dataclass
class JudgeArgs:
    judge_model: str | None = None
    """a generative judge, any HF causal checkpoint (assets/judge-tiny for the built-in task): the `judge`
    term of --rewards, +1 for each verdict yes and -1 for no, averaged over --judge-samples"""
    judge_template: str | None = None
    """--judge-model: the judge's prompt, a str.format (or jinja) string or a file holding one, with the
    fields prompt, completion and any dataset column (default: roles.judge.DEFAULT_TEMPLATE, ending in
    'Verification: Is the answer correct (Yes/No)?')"""
    judge_samples: int = 4
    """--judge-model: verdicts sampled per completion and averaged (G-Core's script: 8)"""
    judge_temperature: float = 0.7
    """--judge-model: the judge's sampling temperature (G-Core's: 0.7)"""
    judge_max_new_tokens: int = 4
    """--judge-model: the length limit of a verdict"""
    judge_chunk: int = 2
    """partial: prompts per chunk that a sampler streams to its judge as soon as they are generated"""
    APPLIES: ClassVar = {  # flags that apply only under another (utils.errors.check_applies)
        **dict.fromkeys(["judge_template", "judge_samples", "judge_temperature", "judge_max_new_tokens"],
                        ("judge_model", bool, "a --judge-model")),
        "judge_chunk": ("placement", lambda p: p == "partial", "--placement partial")}

    def check(self, args):
        """The flags, then (a hub id becomes its snapshot) the checkpoint and the template."""
        check_rules(self, [
            ("judge_model", (self.judge_model is None) == ("judge" not in args.reward.rewards),
             "a judge and the `judge` term of --rewards go together: give both, or neither"),
            ("judge_model", self.judge_model is not None or args.placement.placement != "partial",
             "--placement partial splits the policy's ranks between a sampler and a judge: add a "
             "--judge-model and the `judge` term of --rewards, or use another --placement"),
            ("judge_samples", self.judge_samples >= 1, "use 1 or more"),
            ("judge_temperature", 0 <= self.judge_temperature < math.inf,
             "use 0 (greedy) or a positive number"),
            ("judge_max_new_tokens", self.judge_max_new_tokens >= 1, "use 1 or more"),
            ("judge_chunk", self.judge_chunk >= 1, "use 1 or more prompts")])
        if self.judge_model:
            self.judge_model = local_dir(self.judge_model, "--judge-model")
            check(self.judge_model, self.judge_template)


def metrics(total: dict, peak: dict) -> dict:
    """The judge's metrics from a step's reduced sums and maxima: verdicts that did not parse
    (they count 0), and its time."""
    return {"reward/judge_unparsed": total["judge_unparsed"],
            "reward/judge_unparsed_share": total["judge_unparsed"] / max(1.0, total["judge_verdicts"]),
            "perf/judge_s": peak["judge_s"], "perf/rollout_judge_s": peak["rollout_judge_s"]}


def read_template(value: str | None) -> str:
    """--judge-template: None -> DEFAULT_TEMPLATE; the path of a file -> its text; else the
    template itself. A str.format template, or jinja2 when it holds '{{' or '{%' (so a str.format
    template cannot hold an escaped brace: write that one in jinja2). A value that reads no field
    and looks like a path (one word with a '/' or a file suffix) is a file that is not there, not
    a template: every judge prompt would be that path."""
    if value is None:
        return DEFAULT_TEMPLATE
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" not in value and re.fullmatch(r"\S*(/\S*|\.\w{1,6})", value):
        raise UserError(f"--judge-template {value}: no such file (a template would read {{completion}}); "
                        f"pass the path of a template file, or the template itself")
    return value


def _is_jinja(template: str) -> bool:
    return "{{" in template or "{%" in template


def _fields(template: str) -> set[str]:
    """The variables a template reads ('answer' for '{answer}', '{answer[0]}' or '{{ answer }}')."""
    if _is_jinja(template):
        import jinja2
        import jinja2.meta

        try:
            return jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
        except jinja2.TemplateSyntaxError as e:
            raise UserError(f"--judge-template is not a valid jinja2 template ({e.message}, line {e.lineno})")
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:  # a lone '{' or '}'
        raise UserError(f"--judge-template is not a valid str.format template ({e}): write a literal brace "
                        "as '{{' or '}}'") from None
    return {re.split(r"[.\[]", name, maxsplit=1)[0] for name in names}


def check_template(template: str, columns) -> None:
    """Fails, naming the field, when the template reads a field that is neither prompt, completion
    nor one of `columns` (the dataset's columns: answer, ...). Run once, before the first step."""
    known = {"prompt", "completion", *columns}
    fields = _fields(template)
    for name in sorted(fields):
        if name not in known:
            raise UserError(f"--judge-template reads {{{name}}}, which is no field: the fields are "
                            f"{sorted(known)}; use one of them")
    if "completion" not in fields:
        raise UserError("--judge-template never reads {completion}, so the judge would not see what it "
                        "judges: put {completion} (jinja2: {{ completion }}) where the answer goes")


def render(template: str, prompt, completion: str, row: dict) -> str:
    """The judge's prompt for one completion. row: that completion's dataset columns. A chat
    prompt (a list of messages) is shown as its last message's content."""
    if not isinstance(prompt, str):
        prompt = prompt[-1]["content"]
    values = {**row, "prompt": prompt, "completion": completion}
    if _is_jinja(template):
        import jinja2

        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
        try:
            return env.from_string(template).render(**values)
        except jinja2.UndefinedError:
            check_template(template, row)  # names the field
            raise
    try:
        return template.format(**values)
    except (KeyError, IndexError):
        check_template(template, row)
        raise


def parse_verdict(text: str) -> float | None:
    """+1.0 (yes), -1.0 (no) or None (unparsed) for one judge output.

    Strict first: the whole output is one word, yes or no (any case, an optional '.' or '!').
    Else lenient: the text after the last MARKER when the output restates it (a judge that
    repeats the question answers after its last copy), else the whole output; its first
    standalone yes/no word decides ('Yesterday' and 'nothing' are not verdicts; 'yes/no', the
    question's choice restated, is skipped). Adversarial outputs: 'No, yes' and 'yes ... no'
    take the first word; 'MARKER No ... MARKER Yes' takes Yes."""
    stripped = text.strip()
    if STRICT.fullmatch(stripped):
        return 1.0 if stripped[0] in "yY" else -1.0
    rest = text.rsplit(MARKER, 1)[-1]
    found = WORD.search(CHOICE.sub(" ", rest))
    if found is None:
        return None
    return 1.0 if found.group(1).lower() == "yes" else -1.0


class Judge:
    def __init__(self, engine, tokenizer, weights: dict, template: str, samples: int, temperature: float,
                 max_new_tokens: int, timeout_s: float, max_len: int = 2048):
        """engine: an engine (engines/base.py) for the judge checkpoint; tokenizer: its
        models.tokenizer.Tokenizer; weights: its CPU tensors by HF name (kept: `load` puts them into the
        engine again); max_len: the engine's context (prompt + max_new_tokens); timeout_s: 0 = none."""
        self.engine, self.tok, self.weights, self.template = engine, tokenizer, weights, template
        self.params = SamplingParams(samples, temperature, max_new_tokens=max_new_tokens)
        self.timeout_s, self.max_len = timeout_s, max_len
        self.last_error = None  # why the last `score` call failed; None when it did not
        self.truncated = 0  # judge prompts cut to fit the context, since the start

    def load(self):
        self.engine.load_weights(iter(self.weights.items()))

    def release(self):
        self.engine.release()

    def encode(self, text: str) -> list[int]:
        """A judge prompt's ids. A prompt longer than the context loses its start (left
        truncation): the answer and the question, which the verdict reads, are at the end."""
        ids = self.tok.encode(*self.tok.render(text))
        room = self.max_len - self.params.max_new_tokens
        if len(ids) > room:
            self.truncated += 1
            ids = ids[len(ids) - room:]
        return ids

    def score(self, prompts: list, completions: list[str], columns: dict[str, list], seeds: list[int]):
        """Returns (scores [N] float, unparsed: int). One judge prompt per completion, k verdicts
        each, averaged (an unparsed verdict counts 0). seeds: one per completion, from the policy
        sample's own seed, so that a verdict does not depend on the rank that judges it. Scores
        are NaN where judging failed (`last_error` says why); unparsed counts parsed-less verdicts."""
        N, k = len(completions), self.params.n
        self.last_error = None
        if N == 0:
            return torch.zeros(0), 0
        rows = [{name: values[i] for name, values in columns.items()} for i in range(N)]
        ids = [self.encode(render(self.template, p, c, r)) for p, c, r in zip(prompts, completions, rows)]
        try:
            with time_limit(self.timeout_s):  # in the main thread only (partial's judge thread: none)
                texts = self.engine.generate(ids, self.params, seeds).texts  # N * k, completion-major
        except TimeLimit:
            self.last_error = f"judging {N} completions ran past --reward-timeout-s={self.timeout_s}"
            return torch.full((N,), float("nan")), 0
        except Exception as e:  # noqa: BLE001 (any engine failure fails this call, not the run)
            self.last_error = f"judge engine failed: {type(e).__name__}: {e}"
            return torch.full((N,), float("nan")), 0
        verdicts = [parse_verdict(t) for t in texts]
        unparsed = verdicts.count(None)
        votes = torch.tensor([0.0 if v is None else v for v in verdicts]).view(N, k)  # [N, k]
        return votes.mean(1), unparsed  # [N]


def make_judge(path: str, kind: str, device, dtype, max_model_len: int, seed: int, template: str | None,
               samples: int, temperature: float, max_new_tokens: int, timeout_s: float) -> Judge:
    """The judge of the checkpoint at `path` (--judge-model) on an engine of `kind` (--engine),
    its weights not loaded yet (`Judge.load`). template: as --judge-template (read_template)."""
    check(path, template)
    cfg, tok = read_config(path), Tokenizer(path)
    weights = dict(iter_checkpoint(path))
    engine = make_engine(kind, path, cfg, tok, device, dtype, max_model_len, seed)
    return Judge(engine, tok, weights, read_template(template), samples, temperature, max_new_tokens,
                 timeout_s, max_model_len)


def for_run(args, plan, rows, device, dtype, max_len: int):
    """--judge-model's judge on every trainer rank (partial: the judge ranks only), its template
    checked against the dataset's columns; None without one."""
    cfg = args.judge
    if not cfg.judge_model or (plan.mode == "partial" and plan.is_sampler):
        return None
    judge_len = max_len + 512 + cfg.judge_max_new_tokens  # the template's own words: under 512 tokens
    judge = make_judge(cfg.judge_model, args.sampling.engine, device, dtype, judge_len, args.run_args.seed,
                       cfg.judge_template, cfg.judge_samples, cfg.judge_temperature, cfg.judge_max_new_tokens,
                       args.reward.reward_timeout_s)
    check_template(judge.template, [*dataset_columns(rows[:1], 1), "finish_reason"])
    return judge


def verdict_seeds(prompt_seeds: list[int], n: int) -> list[int]:
    """One judge seed per completion (prompt-major, n per prompt), from its prompt's sampling
    seed: the verdicts then do not depend on which rank judges, nor on the chunking."""
    return [random.Random(f"{s}-judge-{j}").getrandbits(31) for s in prompt_seeds for j in range(n)]


def judge_chunk(judge, rows, seeds, samples, n: int):
    """The judge's scores [N] of one chunk of samples (n per row of `rows`), and its unparsed count."""
    if not rows:
        return torch.zeros(0), 0
    columns = dataset_columns(rows, n)
    columns["finish_reason"] = samples.finish_reasons
    prompts = per_sample([r["prompt"] for r in rows], n)
    texts = samples.transcripts or samples.texts  # an episode is judged whole: its turns and tool replies
    return judge.score(prompts, texts, columns, verdict_seeds(seeds, n))


def check(path: str, template: str | None):
    """--judge-model and --judge-template, before any process group: a readable causal model."""
    check_model_dir(path, "--judge-model")
    try:
        cfg = read_config(path)
        Tokenizer(path)
        check_checkpoint(path)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"--judge-model: {e}") from None
    if cfg.scores:
        raise UserError(f"--judge-model {path} is a {cfg.architecture}, a scoring model: a judge generates "
                        "(a ...ForCausalLM); pass a sequence-classification model as --reward-model")
    read_template(template)
