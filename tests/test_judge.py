"""The judge role (roles/judge.py): verdict parsing, templates, and scoring with the shipped tiny
judge (assets/judge-tiny) on the native engine, failures and time limits with fake engines."""
import math
import os
import signal
import time

import pytest
import torch

from models.tokenizer import Tokenizer
from roles.judge import (DEFAULT_TEMPLATE, MARKER, Judge, check_template, make_judge, parse_verdict,
                         read_template, render)
from utils.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JUDGE = os.path.join(ROOT, "assets", "judge-tiny")


@pytest.mark.parametrize("text, verdict", [
    # well-formed: the whole output is the verdict
    ("Yes", 1.0), (" no.", -1.0), ("YES!", 1.0), ("No", -1.0), ("\n yes \n", 1.0),
    # malformed: no standalone yes/no word
    ("Maybe", None), ("Yesterday", None), ("nothing", None), ("Noyes", None), ("", None), ("   ", None),
    ("(Yes/No)?", None),
    # lenient: the first standalone yes/no word
    ("I think yes, it is right", 1.0), ("Yes.\n", 1.0), ("The sum is 46, so no", -1.0),
    # adversarial: both words (the first wins), the marker restated (after the last copy)
    ("No, yes", -1.0), ("yes ... no", 1.0), ("Yesterday I said no", -1.0),
    (f"{MARKER} No. Let me check again. {MARKER} Yes", 1.0),
    (f"Yes. {MARKER} no", -1.0),
    (f"{MARKER} maybe", None),
    (f"Verification: {MARKER} Yes", 1.0),
])
def test_parse_verdict(text, verdict):
    assert parse_verdict(text) == verdict


def test_templates(tmp_path):
    assert read_template(None) == DEFAULT_TEMPLATE
    text = render(DEFAULT_TEMPLATE, "12+34=", "46", {"answer": "46"})
    assert "Problem: 12+34=\nAnswer: 46\n" in text and text.endswith(MARKER)
    file = tmp_path / "judge.txt"
    file.write_text("Q: {prompt} A: {completion} gold {answer}")
    assert render(read_template(str(file)), "1+1=", "2", {"answer": "2"}) == "Q: 1+1= A: 2 gold 2"
    assert read_template("Q: {prompt}") == "Q: {prompt}"  # not a file: the template itself
    jinja = "{{ prompt }}{% if answer %} (gold {{ answer }}){% endif %} -> {{ completion }}"
    assert render(read_template(jinja), "1+1=", "3", {"answer": "2"}) == "1+1= (gold 2) -> 3"
    assert render("{prompt}", [{"role": "user", "content": "hi"}], "x", {}) == "hi"  # a chat prompt
    check_template(DEFAULT_TEMPLATE, [])
    check_template("{completion} vs {answer}", ["answer"])
    for bad in ("{prompt} {reference}", "{{ reference }} {{ prompt }}"):
        with pytest.raises(UserError, match=r"reference.*'answer', 'completion', 'prompt'"):
            check_template(bad, ["answer"])
        with pytest.raises(UserError, match="reference"):  # at render time too
            render(bad, "1+1=", "2", {"answer": "2"})
    with pytest.raises(UserError, match="str.format"):
        check_template("a lone { brace", [])


@pytest.fixture(scope="module")
def judge():
    j = make_judge(JUDGE, "native", "cpu", torch.float32, 2048, 0, None, samples=4, temperature=1.0,
                   max_new_tokens=4, timeout_s=60)
    j.load()
    return j


@pytest.mark.reordered
def test_tiny_judge_scores(judge):
    from tasks.data import arith_rows

    rows = arith_rows("eval")[:12]
    right = [r["answer"] for r in rows]
    wrong = [str(int(r["answer"]) + d) for r, d in zip(rows, [1, -1, 2, 10, -10, 3, 7, -2, 1, 20, -3, 5])]
    prompts = [r["prompt"] for r in rows] * 2
    columns = {"answer": right * 2}
    seeds = list(range(24))
    scores, unparsed = judge.score(prompts, right + wrong, columns, seeds)
    assert scores.shape == (24,) and judge.last_error is None and unparsed <= 4  # of 96 verdicts, at T=1
    assert int((scores[:12] > 0).sum()) >= 10, scores[:12]  # most right answers judged right
    assert int((scores[12:] < 0).sum()) >= 10, scores[12:]  # most wrong ones judged wrong
    again, _ = judge.score(prompts, right + wrong, columns, seeds)
    assert torch.equal(scores, again)  # the same seeds, the same verdicts
    other, _ = judge.score(prompts[:3], right[:3], {"answer": right[:3]}, seeds[:3])
    assert torch.equal(other, scores[:3])  # a verdict depends on its own seed, not on the batch


class Boom:
    def generate(self, prompts, params, seeds):
        raise RuntimeError("out of memory")


class Hang:
    def generate(self, prompts, params, seeds):
        time.sleep(30)


class Echo:
    """Says yes, and keeps the prompts it was given."""

    def generate(self, prompts, params, seeds):
        from types import SimpleNamespace

        self.prompts = prompts
        return SimpleNamespace(texts=["Yes"] * (len(prompts) * params.n))


def fake_judge(engine, timeout_s=5.0, max_len=2048):
    return Judge(engine, Tokenizer(JUDGE), {}, DEFAULT_TEMPLATE, 2, 1.0, 4, timeout_s, max_len)


def test_judge_failures_are_nan():
    handler = signal.getsignal(signal.SIGALRM)
    j = fake_judge(Boom())
    scores, unparsed = j.score(["1+1="] * 3, ["2", "3", ""], {"answer": ["2"] * 3}, [0, 1, 2])
    assert scores.shape == (3,) and all(math.isnan(s) for s in scores.tolist()) and unparsed == 0
    assert "RuntimeError: out of memory" in j.last_error
    j = fake_judge(Hang(), timeout_s=0.5)
    t = time.perf_counter()
    scores, _ = j.score(["1+1="], ["2"], {"answer": ["2"]}, [0])
    assert time.perf_counter() - t < 3 and math.isnan(scores[0]) and "ran past" in j.last_error
    for _ in range(50):  # an alarm that fires anywhere (before, in or after generate) is caught
        scores, _ = fake_judge(Echo(), timeout_s=1e-6).score(["1+1="], ["2"], {"answer": ["2"]}, [0])
        assert scores.tolist() == [1.0] or math.isnan(scores[0])
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no alarm left behind
    assert signal.getsignal(signal.SIGALRM) == handler  # restored
    scores, _ = fake_judge(Echo()).score(["1+1="], ["2"], {"answer": ["2"]}, [0])
    assert scores.tolist() == [1.0] and j.last_error is not None  # each judge keeps its own last error


def test_long_judge_prompts_lose_their_start():
    echo = Echo()
    j = fake_judge(echo, max_len=24)
    scores, _ = j.score(["1+1=" * 50, "1+1="], ["2", "2"], {"answer": ["2", "2"]}, [0, 1])
    assert scores.tolist() == [1.0, 1.0] and j.truncated >= 1
    assert all(len(p) <= 24 - 4 for p in echo.prompts)
    assert Tokenizer(JUDGE).decode(echo.prompts[0]).endswith(MARKER)  # the end is kept
