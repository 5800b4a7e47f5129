"""--help reads well: every flag of each train script is documented (a docstring under its Args
field, which tyro prints), and --help shows each flag with its default."""
import ast
import dataclasses
import importlib
import inspect
import os
import subprocess
import sys
import textwrap
import typing

import pytest
from test_fsdp import ROOT

SCRIPTS = ["train_grpo.py", "train_ppo.py", "train_rm.py"]


def flag_fields(cls) -> list[tuple[str, bool]]:
    """(flag field, has a docstring) for each field of a flags dataclass, in order; a component's
    nested flags dataclass (run.Flat[...]: its flags keep their own names) is walked in place."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    types = typing.get_type_hints(cls)
    fields = []
    for node, after in zip(body, body[1:] + [None]):
        if not isinstance(node, ast.AnnAssign):
            continue
        name = node.target.id
        if dataclasses.is_dataclass(types[name]):
            fields += flag_fields(types[name])
            continue
        documented = (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                      and isinstance(after.value.value, str) and after.value.value.strip() != "")
        fields.append((name, documented))
    return fields


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
