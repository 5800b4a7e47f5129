"""The judge role: a generative reward model (an LLM judge), in this process or on ranks of its own.

G-Core (Wu et al. 2025, arXiv:2507.22789) scores a completion with a second LLM prompted as a
math teacher: the prompt shows the problem and the student's answer and ends with
"Verification: Is the answer correct (Yes/No)?"; the judge's reply is its verdict. The verdict
is parsed (`parse_verdict`): yes +1, no -1, a reply that says neither 0 (unparsed, counted).
Each completion is judged k times (k samples of the judge, temperature > 0) and its score is
the mean of the k verdicts, in [-1, 1]: G-Core's script uses k = 8 at temperature 0.7.

The judge is a generation engine (utils/engines.py) with weights of its own. Colocated with
training, it loads before judging and releases after (as the policy's engine does), keeping
a CPU copy of its weights. A failure (generate raising, or a call past `timeout_s`) makes the
scores of that call NaN: the trainer counts them in reward/failures; it never stops silently.
`python -m utils.tiny --judge` builds assets/judge-tiny, a tiny judge of the built-in task.

With --placement partial the judge ranks run `judge_stream` each rollout, judging the chunks
their samplers stream to them (roles/rollout.py `sample_and_stream` is the other half).
"""
import os
import random
import re
import signal
import string
import threading
import time

import torch

from utils import dist
from utils.data import Tokenizer, dataset_columns, per_sample
from utils.engines import Samples, SamplingParams, make_engine
from utils.errors import UserError

MARKER = "Is the answer correct (Yes/No)?"
# what assets/judge-tiny was trained on (utils.tiny.judge_checkpoint); a completion comes after
# "Answer:" as the policy wrote it
DEFAULT_TEMPLATE = ("You are a math teacher. Grade the answer.\nProblem: {prompt}\nAnswer: {completion}\n"
                    "Verification: " + MARKER)

STRICT = re.compile(r"(yes|no)[.!]?", re.IGNORECASE)
WORD = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
CHOICE = re.compile(r"yes\s*/\s*no", re.IGNORECASE)  # "(Yes/No)" restated is no verdict


def read_template(value: str | None) -> str:
    """--judge-template: None -> DEFAULT_TEMPLATE; the path of a file -> its text; else the
    template itself. A str.format template, or jinja2 when it holds '{{' or '{%' (so a str.format
    template cannot hold an escaped brace: write that one in jinja2)."""
    if value is None:
        return DEFAULT_TEMPLATE
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
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
    for name in sorted(_fields(template)):
        if name not in known:
            raise UserError(f"--judge-template reads {{{name}}}, which is no field: the fields are "
                            f"{sorted(known)}; use one of them")


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


class JudgeTimeout(BaseException):
    """Not an Exception: nothing on the way (an engine's `except Exception`) swallows it."""


def _alarm(*_):
    raise JudgeTimeout()


class Judge:
    def __init__(self, engine, tokenizer, weights: dict, template: str, samples: int, temperature: float,
                 max_new_tokens: int, timeout_s: float, max_len: int = 2048):
        """engine: a utils.engines engine for the judge checkpoint; tokenizer: its utils.data.Tokenizer;
        weights: its CPU tensors by HF name (kept: `load` puts them into the engine again);
        max_len: the engine's context (prompt + max_new_tokens); timeout_s: 0 = none."""
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
        # SIGALRM interrupts Python code only in the main thread: elsewhere no time limit
        timed = bool(self.timeout_s) and threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGALRM, _alarm) if timed else None
        try:
            try:  # the alarm is set and cleared inside: one that fires at any point here is caught below
                if timed:
                    signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
                texts = self.engine.generate(ids, self.params, seeds).texts  # N * k, completion-major
            finally:
                if timed:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except JudgeTimeout:
            self.last_error = f"judging {N} completions ran past --reward-timeout-s={self.timeout_s}"
            return torch.full((N,), float("nan")), 0
        except Exception as e:  # noqa: BLE001 (any engine failure fails this call, not the run)
            self.last_error = f"judge engine failed: {type(e).__name__}: {e}"
            return torch.full((N,), float("nan")), 0
        finally:
            if timed:
                signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
        verdicts = [parse_verdict(t) for t in texts]
        unparsed = verdicts.count(None)
        votes = torch.tensor([0.0 if v is None else v for v in verdicts]).view(N, k)  # [N, k]
        return votes.mean(1), unparsed  # [N]


def make_judge(path: str, kind: str, device, dtype, max_model_len: int, seed: int, template: str | None,
               samples: int, temperature: float, max_new_tokens: int, timeout_s: float) -> Judge:
    """The judge of the checkpoint at `path` (--judge-model) on an engine of `kind` (--engine),
    its weights not loaded yet (`Judge.load`). template: as --judge-template (read_template)."""
    from utils.model import iter_checkpoint, read_config

    check(path, template)
    cfg, tok = read_config(path), Tokenizer(path)
    weights = dict(iter_checkpoint(path))
    engine = make_engine(kind, path, cfg, tok, device, dtype, max_model_len, seed)
    return Judge(engine, tok, weights, read_template(template), samples, temperature, max_new_tokens,
                 timeout_s, max_model_len)


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
    return judge.score(prompts, samples.texts, columns, verdict_seeds(seeds, n))


def judge_stream(plan, judge, rows, seeds, n: int):
    """A judge rank's part of one partial-placement rollout (`roles.rollout.sample_and_stream`
    is the other part, on the sampler ranks, at the same time).

    Sends: its own prompts (`rows`, `seeds`) to its sampler, first.
    Consumes: `Chunk`s from each sampler, in that sampler's send order: the sampler's own
      prompts' chunks dealt to this rank (when it is among `judges_of` the sampler), then this
      rank's own; each stream ends with a chunk marked `last`.
    Does: judges each chunk as it lands (the judge's weights loaded for the rollout, released
      after it, as a colocated engine's are) and sends a sampler's scores straight back.
    Produces: (its own Samples, their judge scores [N], busy seconds judging, the completions it
      judged and their unparsed verdicts)."""
    from roles.rollout import Prompts

    layout, me = plan.layout, plan.rank
    sent = dist.isend_obj(Prompts([r["ids"] for r in rows], seeds), layout.sampler_of(me))
    judge.load()
    mine, scores, busy, taken = [], [], 0.0, 0
    judged_count, unparsed = 0, 0
    for sampler in range(layout.sampler):
        owners = []
        if me in layout.judges_of(sampler):
            owners.append(sampler)
        if layout.sampler_of(me) == sampler:
            owners.append(me)
        for owner in owners:
            while True:
                chunk = dist.recv_or_fail(sampler, "its sampler's samples")
                t = time.perf_counter()
                chunk_rows = chunk.rows
                if owner == me:
                    chunk_rows = rows[taken:taken + len(chunk.seeds)]
                    taken += len(chunk.seeds)
                judged, missed = judge_chunk(judge, chunk_rows, chunk.seeds, chunk.samples, n)
                busy += time.perf_counter() - t
                judged_count += len(judged)
                unparsed += missed
                if owner == me:
                    mine.append(chunk.samples)
                    scores.append(judged)
                else:
                    sent += dist.isend_obj(judged, owner)
                if chunk.last:
                    break
    judge.release()
    dist.wait_all(sent)
    return Samples.cat(mine), torch.cat(scores), busy, judged_count, unparsed


def check(path: str, template: str | None):
    """--judge-model and --judge-template, before any process group: a readable causal model."""
    from utils.model import check_checkpoint, read_config

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
