import pytest

from roles.reward import Reward, extract_answer, same_answer


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
    total, parts, failures = r.score(["1+1="] * 3, ["2", "3", "2"], {
        "answer": ["2", "2", "2"], "finish_reason": ["stop", "stop", "length"]})
    assert total.tolist() == [1.5, 0.5, 1.0] and failures == 0
    assert parts["accuracy"].tolist() == [1, 0, 1]


def test_raising_reward_is_counted_per_sample_not_fatal():
    r = Reward(["tests.helpers.rewards:flaky"])
    total, _, failures = r.score(["p"] * 4, ["a2", "b3", "c4", "d5"], {"answer": ["0"] * 4})
    assert failures == 2 and total.tolist() == [1.0, 0.0, 1.0, 0.0]


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
