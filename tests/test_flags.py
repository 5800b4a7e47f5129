"""--help reads well: every flag of each train script is documented (a docstring under its Args
field, which tyro prints), and --help shows each flag with its default."""
import ast
import dataclasses
import glob
import importlib
import inspect
import os
import re
import shlex
import subprocess
import sys
import textwrap
import typing

import pytest
from test_fsdp import ROOT

SCRIPTS = ["train_grpo.py", "train_ppo.py", "train_rm.py", "train_flow_grpo.py"]


def flag_docs(cls) -> dict[str, tuple[type, str]]:
    """{flag field: (its type, its docstring, "" if none)} for each field of a flags dataclass, in
    order; a component's nested flags dataclass (flags.Flat[...]: its flags keep their own names) is
    walked in place."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    types = typing.get_type_hints(cls)
    fields = {}
    for node, after in zip(body, body[1:] + [None]):
        if not isinstance(node, ast.AnnAssign):
            continue
        name = node.target.id
        if types[name] is typing.ClassVar or typing.get_origin(types[name]) is typing.ClassVar:
            continue  # APPLIES: not a flag
        if dataclasses.is_dataclass(types[name]):
            fields.update(flag_docs(types[name]))
            continue
        doc = ""
        is_text = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        text = after.value.value if is_text else None
        if isinstance(text, str):
            doc = " ".join(text.split())
        fields[name] = (types[name], doc)
    return fields


def flag_fields(cls) -> list[tuple[str, bool]]:
    """(flag field, has a docstring) for each field of a flags dataclass, in order."""
    return [(name, doc != "") for name, (_, doc) in flag_docs(cls).items()]


def args_fields(script: str) -> list[tuple[str, bool]]:
    """(flag, has a docstring) for each flag of the script's `Args`, in order."""
    return flag_fields(importlib.import_module(script.removesuffix(".py")).Args)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_has_a_docstring_and_help_shows_it_with_its_default(script):
    fields = args_fields(script)
    assert len(fields) > 5
    assert [name for name, documented in fields if not documented] == []
    p = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0, p.stderr[-2000:]
    for name, _ in fields:
        assert f"--{name.replace('_', '-')}" in p.stdout, name
    assert p.stdout.count("(default:") >= len(fields) - 2, p.stdout[-2000:]  # required flags show none


SCRIPT = re.compile(r"\btrain_(grpo|ppo|rm|flow_grpo)\.py\b")
PLACEHOLDER = {"K": "1", "B": "2", "P": "0.5", "C": "2", "L": "0.5", "H": "2", "S": "1", "N": "2",
               "DIR": "assets/judge-tiny"}  # the letters the docs write for a value of the reader's


def doc_commands() -> list[tuple[str, str, list[str], list[str]]]:
    """(where, script, launcher, flags) for each command in README.md and docs/*.md that runs a
    train script: a code line (indented or fenced; `\\` continues it) that runs the script with
    torchrun or python; and each inline `--flag ...` span of two or more flags (script None: the
    first script whose flags parse it; launched on 2 ranks)."""
    found = []
    for path in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        name, text, fence, code = os.path.relpath(path, ROOT), open(path).read(), False, []
        for no, line in enumerate(text.splitlines(), 1):
            fence ^= line.startswith("```")
            if fence or line.startswith("    "):
                code.append((no, line))
        joined = []
        for no, line in code:
            if joined and joined[-1][1].endswith("\\"):
                joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line.strip())
            else:
                joined.append((no, line.strip()))
        for no, line in joined:
            script = SCRIPT.search(line)
            if not script or line.startswith(("#", "`")):
                continue
            words = shlex.split(line.split(" # ")[0].split("  #")[0])
            at = [i for i, w in enumerate(words) if w == script.group(0)]
            if not at or not any(re.search(r"torchrun|python", w) for w in words[:at[0]]):
                continue  # named, not run (the layout, a comment)
            rest = [w for w in words[at[0] + 1:] if w != "..."]
            found.append((f"{name}:{no}", script.group(0), words[:at[0]], rest))
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        for span in re.findall(r"`(--[a-z][^`]*)`", prose):
            words = shlex.split(span)
            if sum(w.startswith("--") for w in words) >= 2:
                found.append((f"{name}: `{span}`", None, ["torchrun", "--nproc-per-node", "2"], words))
    return found


DOCS = doc_commands()
STAND_INS = {"/path/to/Qwen2.5-0.5B-Instruct": "assets/arith-tiny",
             "/shared/Qwen2.5-1.5B-Instruct": "assets/arith-tiny"}


def test_the_docs_name_their_commands():
    where = [w for w, *_ in DOCS]
    assert any("README.md:11" == w for w in where) and any("mypkg.rewards:my_fn" in w for w in where)
    assert sum(s is not None for _, s, _, _ in DOCS) >= 10, where


def launched(launcher: list[str]) -> tuple[int, dict]:
    """(world size, what torchrun puts in the environment that check_args reads) of a launcher."""
    world, env = 1, {}
    for flag in ("--nproc-per-node", "--nnodes"):
        if flag in launcher:
            value = launcher[launcher.index(flag) + 1]
            world *= int(value) if value.isdigit() else 2  # $SLURM_NNODES: say two nodes
    if "--max-restarts" in launcher:
        env["TORCHELASTIC_MAX_RESTARTS"] = launcher[launcher.index("--max-restarts") + 1]
    return world, env


@pytest.mark.parametrize("where,script,launcher,flags", DOCS, ids=[w[:60] for w, *_ in DOCS])
def test_every_command_in_the_docs_parses_and_passes_check_args(where, script, launcher, flags, tmp_path,
                                                                monkeypatch, rm_dir):
    """A command in README.md or docs/ is parsed by its script's flags and passes its check_args
    (what the script runs before the process group), so the docs cannot drift from the code. A
    machine's path in them stands for the shipped tiny model, runs/rm for a tiny reward model, and
    a span's placeholder letters (K, DIR, ...) for a value; a span with placeholders is a fragment
    of a command and is only parsed."""
    import tyro

    world, env = launched(launcher)
    for key, value in {"HF_HUB_OFFLINE": "1", **env}.items():
        monkeypatch.setenv(key, value)
    stand_ins = {**STAND_INS, "runs/rm": rm_dir}
    fragment = script is None and any(w in PLACEHOLDER for w in flags)
    flags = [stand_ins.get(PLACEHOLDER.get(w, w), PLACEHOLDER.get(w, w)) for w in flags]
    errors = []
    for name in [script] if script else SCRIPTS:
        train = importlib.import_module(name.removesuffix(".py"))
        out = ["--out" if name == "train_rm.py" else "--run-dir", str(tmp_path / "run")]
        try:
            args = tyro.cli(train.Args, args=[*flags, *out])
            if not fragment:
                train.check_args(args, world)
            return
        except (SystemExit, ValueError) as e:
            errors.append(f"{name}: {e!r}")
    pytest.fail(f"{where}: {flags} does not run: {errors}")


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    from test_reward_model import hf_reward_model

    path = str(tmp_path_factory.mktemp("rm"))
    hf_reward_model(path)
    return path
