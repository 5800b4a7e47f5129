"""--help reads well: every flag of each train script is documented (a docstring under its Args
field, which tyro prints), and --help shows each flag with its default."""
import ast
import os
import subprocess
import sys

import pytest
from test_fsdp import ROOT

SCRIPTS = ["train_grpo.py", "train_ppo.py", "train_rm.py"]


def args_fields(script: str) -> list[tuple[str, bool]]:
    """(field, has a docstring) for each field of the script's `Args` dataclass, in order."""
    tree = ast.parse(open(os.path.join(ROOT, script)).read())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Args").body
    fields = []
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign):
            documented = (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                          and isinstance(after.value.value, str) and after.value.value.strip() != "")
            fields.append((node.target.id, documented))
    return fields


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
