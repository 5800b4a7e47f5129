"""The style report: sizes that hint a file has two jobs, printed after the tests (.ci/run).

Limits are smoke detectors, not targets (../docs/design.md): a train script over 400 lines, a role
file over 300, placement.py over 350, teach_grpo.py over 300 or a line over 110 characters is listed
here, for the reader to split it by job, and never fails the build. What fails (exit 1) is a step
loop (the body of `for step in ...:` in a train_*.py) over 40 lines: the loop shows the algorithm,
and each feature adds at most one line to it. A fork's test suite then fails on bugs only.

    python .ci/style_report.py
"""
import ast
import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP_LINES = 40  # the one limit that fails
HINTS = {"train script": ("train_*.py", 400), "role": ("roles/*.py", 300), "placement": ("placement.py", 350),
         "teaching script": ("teach_grpo.py", 300)}  # the teaching script: read in one sitting
LINE_CHARS = 110


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def python_files() -> list[str]:
    """The tracked .py files (a clean clone's), else those on disk outside hidden folders."""
    p = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if p.returncode == 0 and p.stdout.strip():
        return sorted(p.stdout.split())
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [os.path.relpath(os.path.join(folder, n), ROOT) for n in files if n.endswith(".py")]
    return sorted(found)


def step_loops(code: str) -> list[ast.For]:
    """Every `for step in ...:` loop of a module's source (nested ones too)."""
    return [node for node in ast.walk(ast.parse(code)) if isinstance(node, ast.For)
            and isinstance(node.target, ast.Name) and node.target.id == "step"]


def body_lines(loop: ast.For) -> int:
    """Lines from the first statement of the body to the end of the last (blank lines and
    comments between them included), not the `for` line."""
    return loop.body[-1].end_lineno - loop.body[0].lineno + 1


def check_the_measure():
    """The loop measure on a made-up script: the body of `for step in` (a nested one too), not the
    header or what follows; other loops are not step loops. A measure that counts wrong fails."""
    code = ("x = 0\nfor step in range(3):\n    a = 1\n\n    b = [\n        2]\nfor i in range(2):\n    pass\n"
            "def main():\n    for step in range(1):\n        pass\n")
    got = [(loop.lineno, body_lines(loop)) for loop in step_loops(code)]
    assert got == [(2, 4), (10, 1)], got


def main() -> int:
    check_the_measure()
    failed = 0
    print(f"step loops (fail over {LOOP_LINES} lines):")
    scripts = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "train_*.py")))
    for path in scripts:
        for loop in step_loops(read(path)):
            body = body_lines(loop)
            failed += body > LOOP_LINES
            print(f"  {path}:{loop.lineno}: {body} lines{'  OVER: FAILS' if body > LOOP_LINES else ''}")
    if not scripts or failed:
        print("no train script found" if not scripts else f"{failed} step loop(s) over {LOOP_LINES} lines")
        return 1
    print("files over their size hint (a hint of two jobs: split by job; never squeeze to fit):")
    over = 0
    for kind, (pattern, limit) in HINTS.items():
        for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
            lines = len(read(path).splitlines())
            if lines > limit:
                over += 1
                print(f"  {os.path.relpath(path, ROOT)}: {lines} lines, over the {kind} hint of {limit}")
    print("  none" if not over else f"  {over} file(s)")
    long = [f"  {path}:{n}: {len(line)} characters" for path in python_files()
            for n, line in enumerate(read(path).splitlines(), 1) if len(line) > LINE_CHARS]
    print(f"lines over {LINE_CHARS} characters: {len(long) or 'none'}", *long[:20], sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
