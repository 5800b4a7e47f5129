"""Datasets, the built-in task, tokenizer and chat template, per-rank sharding."""
import json

import pytest

from models.tokenizer import Tokenizer, train_tokenizer
from tasks.data import BUILTIN, arith_rows, load_rows, prompt_seed, rank_slice, step_indices, tokenize_rows


def test_builtin_task_is_deterministic_and_eval_is_held_out():
    assert arith_rows("train", seed=1)[:50] == arith_rows("train", seed=1)[:50]
    assert arith_rows("train", seed=1)[:50] != arith_rows("train", seed=2)[:50]
    evals = {r["prompt"] for r in arith_rows("eval")}
    assert len(evals) == 256
    assert not evals & {r["prompt"] for r in arith_rows("train")}
    r = arith_rows("eval")[0]
    a, b = r["prompt"].rstrip("=").split("+")
    assert int(a) + int(b) == int(r["answer"])


def test_local_jsonl_with_named_columns(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"question": f"q{i}", "gold": i, "level": i % 2}) for i in range(5)))
    rows = load_rows(str(f), "train", "question", "gold")
    assert [r["prompt"] for r in rows] == [f"q{i}" for i in range(5)]
    assert rows[3]["answer"] == "3" and rows[3]["level"] == 1  # other columns travel with the row


def test_parquet_file(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}]).to_parquet(str(tmp_path / "d.parquet"))
    assert load_rows(str(tmp_path / "d.parquet"), "train", "prompt", "answer")[0]["answer"] == "1"


def test_missing_prompt_column_names_it(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"question": "x", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"no prompt column 'prompt'.*\['question', 'answer'\]"):
        load_rows(str(f), "train", "prompt", "answer")


def test_empty_dataset_is_an_error(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_rows(str(f), "train", "prompt", None)


def test_malformed_row_is_named_by_index(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p}) for p in ["ok", "", "fine"]))
    with pytest.raises(ValueError, match="row 1"):
        load_rows(str(f), "train", "prompt", None)


def test_chat_template_is_applied(tmp_path):
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    train_tokenizer(["hello world 1+2=3"] * 10, str(tmp_path), 300, chat_template=template)
    tok = Tokenizer(str(tmp_path))
    rows, skipped = tokenize_rows([{"prompt": "1+2="}], tok, 100)
    assert rows[0]["text"] == "<|user|>1+2=<|endoftext|><|assistant|>"
    assert tok.decode(rows[0]["ids"]) == "<|user|>1+2=<|assistant|>"  # EOS is special: skipped in decode
    _, skipped = tokenize_rows([{"prompt": "1+2="}, {"prompt": "x" * 200}], tok, 100)
    assert skipped == 1


def test_builtin_needs_no_files():
    rows = load_rows(BUILTIN, "eval", "prompt", "answer")
    assert len(rows) == 256 and rows[0]["answer"].isdigit()


def test_step_indices_cover_an_epoch_and_ranks_split_it():
    seen = [i for s in range(5) for i in step_indices(40, s, 8, seed=0)]
    assert sorted(seen) == list(range(40))
    batch = step_indices(40, 2, 8, seed=0)
    assert rank_slice(batch, 0, 2) + rank_slice(batch, 1, 2) == batch
    with pytest.raises(ValueError, match="multiple of 3"):
        rank_slice(batch, 0, 3)
    assert prompt_seed(0, 3, 5) == prompt_seed(0, 3, 5) != prompt_seed(0, 3, 6)
