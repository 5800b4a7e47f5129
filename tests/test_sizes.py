"""Size guards (STYLE.md: a short step loop, one job per file): a train script over 400 lines,
its step loop (the body of `for step in ...`) over 70, a role file over 300, placement.py over
350, or a line of a tracked .py file over 110 characters fails here, each offender named with
file:line."""
import ast
import glob
import os
import subprocess

from test_fsdp import ROOT

SCRIPT_LINES, LOOP_LINES, ROLE_LINES, PLACEMENT_LINES, LINE_CHARS = 400, 70, 300, 350, 110


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
        for name in files:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(folder, name), ROOT))
    return sorted(found)


def train_scripts() -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "train_*.py")))


def too_long(paths: list[str], limit: int) -> list[str]:
    out = []
    for path in paths:
        lines = len(read(path).splitlines())
        if lines > limit:
            out.append(f"{path}:{lines}: {lines} lines, over {limit}")
    return out


def step_loops(code: str) -> list[ast.For]:
    """Every `for step in ...:` loop of a module's source."""
    loops = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and node.target.id == "step":
            loops.append(node)
    return loops


def body_lines(loop: ast.For) -> int:
    """Lines from the first statement of the body to the end of the last (blank lines and
    comments between them included)."""
    return loop.body[-1].end_lineno - loop.body[0].lineno + 1


def test_the_train_scripts_are_short():
    assert train_scripts()
    offenders = too_long(train_scripts(), SCRIPT_LINES)
    assert not offenders, "\n".join(offenders)


def test_each_step_loop_is_short():
    offenders, loops = [], 0
    for path in train_scripts():
        for loop in step_loops(read(path)):
            loops += 1
            body = body_lines(loop)
            if body > LOOP_LINES:
                offenders.append(f"{path}:{loop.lineno}: the step loop's body is {body} lines, "
                                 f"over {LOOP_LINES}")
    assert loops >= 1  # the guard found the loops it guards
    assert not offenders, "\n".join(offenders)


def test_each_role_file_is_short():
    roles = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "roles", "*.py")))
    assert roles
    offenders = too_long(roles, ROLE_LINES)
    assert not offenders, "\n".join(offenders)


def test_placement_is_short():
    offenders = too_long(["placement.py"], PLACEMENT_LINES)
    assert not offenders, "\n".join(offenders)


def test_no_line_is_over_110_characters():
    offenders = []
    for path in python_files():
        for number, line in enumerate(read(path).splitlines(), 1):
            if len(line) > LINE_CHARS:
                offenders.append(f"{path}:{number}: {len(line)} characters")
    assert not offenders, f"{len(offenders)} lines over {LINE_CHARS} characters:\n" + "\n".join(offenders)


def test_the_loop_measure_counts_the_body_only():
    """On a made-up script: the body of `for step in` (a nested one too), not the header or
    what follows; other loops are not step loops."""
    code = ("x = 0\nfor step in range(3):\n    a = 1\n\n    b = [\n        2]\nfor i in range(2):\n    pass\n"
            "def main():\n    for step in range(1):\n        pass\n")
    loops = step_loops(code)
    assert [(loop.lineno, body_lines(loop)) for loop in loops] == [(2, 4), (10, 1)]
