"""User reward functions for the tests, loaded as `tests.helpers.rewards:NAME`."""


def flaky(prompts, completions, **columns):
    """Raises whenever the batch holds a completion ending in an odd digit; 1.0 otherwise."""
    if any(c[-1:] in "13579" for c in completions):
        raise RuntimeError("flaky reward")
    return [1.0] * len(completions)


def wrong_length(prompts, completions, **columns):
    return [0.0]


def length_bonus(prompts, completions, answer, **columns):
    return [len(c) / 10 for c in completions]


def slow(prompts, completions, **columns):
    import time
    time.sleep(30)
    return [1.0] * len(completions)


def swallows_everything(prompts, completions, **columns):
    """A function that catches Exception around a long wait: the time limit still stops it."""
    import time
    try:
        time.sleep(30)
    except Exception:
        pass
    return [1.0] * len(completions)


def always_fails(prompts, completions, **columns):
    raise RuntimeError("this reward always fails")


def nan_for_odd(prompts, completions, **columns):
    """NaN for a completion ending in an odd digit, else 1."""
    return [float("nan") if c[-1:] in "13579" else 1.0 for c in completions]


def words(prompts, completions, **columns):
    return ["good"] * len(completions)


def constant(prompts, completions, **columns):
    """The same reward for every sample: no group carries a signal."""
    return [0.5] * len(completions)


def wrong_length_on_rank_1(prompts, completions, **columns):
    """A mistake only rank 1 meets, while rank 0 goes on into the step's collectives."""
    import os
    return [0.0] if os.environ.get("RANK") == "1" else [1.0] * len(completions)


def forgets_return(prompts, completions, **columns):
    """Computes its scores and never returns them: None."""
    [float(len(c)) for c in completions]
