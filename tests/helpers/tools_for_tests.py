"""Tools that misbehave, for tests/test_episodes.py (run in tasks.env's tool process)."""
import os
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


def boom(x: int) -> int:
    """Raises."""
    raise ValueError("no good")


def hang(x: int) -> int:
    """Never returns."""
    time.sleep(1000)
    return x


def shout(x: int) -> str:
    """Prints junk to stdout and stderr, then answers."""
    print("junk " * 100)
    os.write(1, b"more junk\n")
    os.write(2, b"err junk\n")
    return "ok"


def huge(x: int) -> str:
    """A very long answer."""
    return "7" * 1_000_000


def thing(x: int):
    """Returns an object that is not text."""
    return object()


def die(x: int) -> int:
    """The process dies."""
    os._exit(3)


def hog(x: int) -> int:
    """Allocates without bound."""
    blocks = []
    while True:
        blocks.append(bytearray(100 << 20))
