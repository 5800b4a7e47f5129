"""The picture of a run, and the summary line, from a small metrics.jsonl."""
import json
import subprocess
import sys

import pytest
from test_fsdp import ROOT


def write_run(run_dir):
    rows = []
    for step in range(6):
        row = {"step": step, "rollout/reward": 0.2 + 0.05 * step, "rollout/response_len": 3.5,
               "perf/generate_s": 0.05, "perf/train_s": 0.3, "perf/sync_s": 0.02, "perf/step_s": 0.4,
               "perf/tokens_per_s": 4000.0, "perf/peak_mem_gib": 0.5}
        if step % 3 == 0:
            row["eval/accuracy"] = 0.2 + 0.1 * step
        rows.append(row)
    rows.append({"step": 5, "final": True, "eval/accuracy": 0.8})
    run_dir.mkdir(exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_plot_command_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    write_run(tmp_path)
    p = subprocess.run([sys.executable, "-m", "utils.plot", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "wrote" in p.stdout, p.stderr
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000  # a real picture, not an empty file


def test_without_matplotlib_it_says_how_to_get_it_and_goes_on(tmp_path):
    write_run(tmp_path)
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from utils.plot import plot\n"
            f"assert plot({str(tmp_path)!r}) is None\n"
            "print('went on')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "pip install matplotlib" in p.stdout and "went on" in p.stdout
    assert not (tmp_path / "curves.png").exists()


def test_the_summary_gives_start_and_end_accuracy_time_shares_and_where_things_are(tmp_path):
    from utils.logger import Logger

    log = Logger(str(tmp_path), {}, 6)
    write_run(tmp_path)  # the rows a run would have written
    text = log.summary(str(tmp_path / "final"), str(tmp_path / "curves.png"))
    log.close()
    assert "held-out accuracy 0.200 at the start, 0.800 at the end (3 evals)" in text
    assert "6 steps in" in text and "(2s in steps: generate 12%, train 75%, weight sync 5%)" in text
    assert "4000 tokens/s; peak memory 0.50 GiB" in text
    assert f"final model {tmp_path / 'final'}" in text and "curves.png" in text
