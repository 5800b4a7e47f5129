"""The house's import check (.ci/imports.py, run by .ci/run on the whole tree) finds what it is for:
an upward import, a circle, a project import hidden inside a function; and lets through what the
rules allow (imports down, within a folder, a deferred optional package)."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("imports_check", os.path.join(ROOT, ".ci", "imports.py"))
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def tree(tmp_path, files: dict[str, str]) -> list[str]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return check.findings(str(tmp_path))[0]


def test_imports_down_and_within_a_folder_pass(tmp_path):
    found = tree(tmp_path, {
        "utils/errors.py": "",
        "models/config.py": "from utils.errors import UserError\n",
        "models/decoder.py": "from models.config import ModelConfig\nfrom utils import errors\n",
        "rl/algos.py": "from models.decoder import token_logprobs\n",
        "roles/actor.py": "from models import decoder\nfrom rl import algos\n",
        "run.py": "import placement\nfrom roles.actor import Actor\n",
        "placement.py": "from roles import actor\n",
        "train_grpo.py": "import run\nfrom placement import plan\n",
        "engines/native.py": "def f():\n    import vllm  # a package of its own\n",
        "engines/vllm_transfer.py": "import vllm\n",
        "engines/make.py": "def f():\n    from engines import vllm_transfer  # defers vllm\n",
    })
    assert found == []


def test_an_upward_import_is_found(tmp_path):
    found = tree(tmp_path, {
        "utils/errors.py": "from roles.actor import Actor\n",
        "roles/actor.py": "",
        "models/decoder.py": "from rl.algos import head\n",
        "rl/algos.py": "",
        "roles/teacher.py": "import run\n",
        "run.py": "",
        "tasks/data.py": "from rl import algos\n",  # beside each other (layer 2), not in one folder
    })
    upward = ["models/decoder.py", "roles/teacher.py", "tasks/data.py", "utils/errors.py"]
    assert sorted(f.split(":")[0] for f in found) == upward
    assert all("imports go down" in f for f in found)


def test_a_circle_is_found_within_a_folder(tmp_path):
    found = tree(tmp_path, {
        "models/decoder.py": "from models.qwen2_vl import VL\n",
        "models/qwen2_vl.py": "from models.decoder import Transformer\n",
    })
    assert found == ["circle of 2: models.decoder, models.qwen2_vl"]


def test_a_project_import_inside_a_function_is_found_unless_it_defers_a_package(tmp_path):
    found = tree(tmp_path, {
        "utils/dist.py": "",
        "models/hf.py": "def load():\n    from utils.dist import shard\n",
        "models/lora.py": "def export():\n    from utils import dist  # defers vllm\n",
    })
    assert found == ["models/hf.py:2: imports utils.dist inside a function (move it to the header)"]
