import pytest

from roles.reward import Reward
from tasks.rewards import extract_answer, same_answer


@pytest.mark.parametrize("text,want", [
    ("so the answer is 42", "42"), ("12 then 7.5", "7.5"), ("x \\boxed{\\frac{1}{2}} y 3", "\\frac{1}{2}"),
    ("work\n#### 1,234\nmore", "1,234"), ("no number", None), ("-3", "-3")])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_same_answer_normalises_numbers():
    assert same_answer("1,234", "1234") and same_answer("5.0", "5") and not same_answer("5", "6")
    assert not same_answer(None, "1")


def test_builtin_terms_and_weights():
    r = Reward(["accuracy", "format"], [1.0, 0.5])
    total, parts, failed = r.score(["1+1="] * 3, ["2", "3", "2"], {
        "answer": ["2", "2", "2"], "finish_reason": ["stop", "stop", "length"]})
    assert total.tolist() == [1.5, 0.5, 1.0] and not failed.any()
    assert parts["accuracy"].tolist() == [1, 0, 1]


def test_raising_reward_is_counted_per_sample_not_fatal():
    r = Reward(["tests.helpers.rewards:flaky"])
    total, _, failed = r.score(["p"] * 4, ["a2", "b3", "c4", "d5"], {"answer": ["0"] * 4})
    assert failed.tolist() == [False, True, False, True] and total.tolist() == [1.0, 0.0, 1.0, 0.0]


def test_wrong_length_is_a_clear_error():
    r = Reward(["tests.helpers.rewards:wrong_length"])
    with pytest.raises(ValueError, match="returned 1 scores for 3 completions"):
        r.score(["p"] * 3, ["a", "b", "c"], {})


def test_bad_reward_names():
    with pytest.raises(ValueError, match="module:function"):
        Reward(["nonsense"])
    with pytest.raises(ValueError, match="could not be loaded"):
        Reward(["tests.helpers.rewards:missing"])
    with pytest.raises(ValueError, match="reward-weights"):
        Reward(["accuracy"], [1.0, 2.0])


def test_reward_past_the_time_limit_scores_zero_and_is_counted():
    import time

    for fn in ("slow", "swallows_everything"):
        r = Reward([f"tests.helpers.rewards:{fn}"], timeout_s=0.5)
        t = time.time()
        total, _, failed = r.score(["p"] * 3, ["a", "b", "c"], {})
        assert time.time() - t < 5 and failed.all() and total.tolist() == [0, 0, 0]


SAFE = "```python\ndef add(a, b):\n    return a + b\n```"
HOSTILE = {
    "loops forever": "while True:\n    pass",
    "allocates without bound": "x = []\nwhile True:\n    x.append(bytearray(10**7))",
    "opens a socket": ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\n"
                       "print('connected')"),
    "forks and hangs": "import os, time\nif os.fork() == 0:\n    time.sleep(60)\ntime.sleep(60)",
    "kills its parent": "import os\nos.kill(os.getppid(), 9)",
}


def test_code_reward_runs_tests_in_a_sandbox():
    import time

    r = Reward(["code"], code_timeout_s=2, code_memory_mb=256)
    tests = "assert add(2, 3) == 5"
    total, _, failed = r.score(["p"] * 2, [SAFE, SAFE.replace("a + b", "a - b")], {"tests": [tests, tests]})
    assert total.tolist() == [1.0, 0.0] and not failed.any()
    for what, code in HOSTILE.items():
        t = time.time()
        total, _, _ = r.score(["p"], [f"```python\n{code}\n```"], {"tests": [""]})
        assert total.tolist() == [0.0], what  # and this process is still here to check it
        assert time.time() - t < 10, what


def test_code_reward_sandbox_has_no_network():
    """A server listens on this machine's loopback; the same code reaches it from a plain
    subprocess but not from the sandbox (whose loopback is a namespace of its own)."""
    import socket
    import subprocess
    import sys

    from utils.sandbox import run_sandboxed

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)\n"
    # reachable without the sandbox
    assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0
    assert not run_sandboxed(code, timeout_s=5)
    server.close()
