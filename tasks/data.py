"""Tokenizer, prompt datasets and the built-in arithmetic task.

Prompts come through the `datasets` library from a local jsonl/json/parquet file or
a hub id (the network is touched only for a hub id). The built-in task needs nothing
but a seed. Each rank takes its own slice of every step's prompts (parallel
controllers: nobody gathers the batch), and each prompt's sampling seed depends on
(seed, step, position in the global batch) only, not on the rank that holds it.
"""
import json
import os
import random
import warnings
from typing import TYPE_CHECKING, TypedDict

from models import vision
from models.packing import pack, plan_bins, prompt_keys, split_to
from models.tokenizer import Tokenizer
from tasks import carries, squares
from utils.dist import reduce
from utils.errors import UserError

if TYPE_CHECKING:
    import torch

BUILTIN = "builtin:arith"
MULTIPLY = "builtin:multiply"  # needs its tool: --tools tasks.env:multiply (tasks/env.py)

# ---------------------------------------------------------------- the built-in task

def arith_problem(rng: random.Random, digits: int = 2) -> dict:
    """Integer addition; the answer is checked as the last number of the completion."""
    a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def arith_rows(split: str, seed: int = 0, n_train: int = 20000, n_eval: int = 256,
               digits: int = 2) -> list[dict]:
    """Deterministic in `seed`; the eval split holds problems that never appear in train."""
    rng = random.Random(f"arith-eval-{seed}")
    evals = []
    seen = set()
    while len(evals) < n_eval:
        r = arith_problem(rng, digits)
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            evals.append(r)
    if split == "eval":
        return evals
    rng = random.Random(f"arith-train-{seed}")
    train = []
    while len(train) < n_train:
        r = arith_problem(rng, digits)
        if r["prompt"] not in seen:
            train.append(r)
    return train


def multiply_rows(split: str, seed: int = 0, n_train: int = 20000, n_eval: int = 256) -> list[dict]:
    """Products of 2-3-digit integers: a tiny model cannot multiply in its head, but it can call
    a calculator tool (tasks.env.multiply) and copy the result. Eval problems never in train."""
    def problem(rng):
        a, b = rng.randrange(10, 1000), rng.randrange(10, 1000)
        return {"prompt": f"{a}*{b}=", "answer": str(a * b)}

    rng, evals = random.Random(f"multiply-eval-{seed}"), {}
    while len(evals) < n_eval:
        r = problem(rng)
        evals[r["prompt"]] = r
    if split == "eval":
        return list(evals.values())
    rng, train = random.Random(f"multiply-train-{seed}"), []
    while len(train) < n_train:
        r = problem(rng)
        if r["prompt"] not in evals:
            train.append(r)
    return train


TASKS = {BUILTIN: arith_rows, MULTIPLY: multiply_rows, squares.NAME: squares.square_rows,
         carries.NAME: carries.carry_rows}


# ---------------------------------------------------------------- prompt datasets

def read_dataset(source: str, split: str):
    """A local .jsonl/.json/.parquet file or a hub dataset id as a `datasets.Dataset`, or a
    UserError naming the file, the line or the id at fault."""
    import datasets

    datasets.disable_progress_bars()
    # its own messages about a file it cannot parse name no line: the errors below do
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    if os.path.exists(source):
        ext = os.path.splitext(source)[1].lstrip(".")
        kind = {"jsonl": "json", "json": "json", "parquet": "parquet"}.get(ext)
        if kind is None:
            raise UserError(f"dataset file {source!r}: expected .jsonl, .json or .parquet")
        if os.path.getsize(source) == 0:
            raise UserError(f"dataset {source!r} is empty")
        try:
            ds = datasets.load_dataset(kind, data_files=source, split="train")
        except Exception as e:  # a parse error deep in pyarrow: find the line ourselves
            raise UserError(_unreadable(source, ext, e)) from None
    elif source.endswith((".jsonl", ".json", ".parquet")) or source.startswith(("/", ".", "~")):
        raise UserError(f"dataset file {source!r} does not exist")  # a path, not a hub id
    else:  # a hub id: the only place the network is used
        try:
            ds = datasets.load_dataset(source, split=split)
        except Exception as e:  # offline, a wrong id, a missing split
            raise UserError(f"dataset {source!r} could not be loaded as a hub dataset ({type(e).__name__}: "
                            f"{str(e)[:200]}); offline, pass a local .jsonl/.json/.parquet file") from None
    return ds


def is_prompt(p) -> bool:
    """A non-empty string or a non-empty list of {'role', 'content'} chat messages."""
    if isinstance(p, str):
        return bool(p)
    return isinstance(p, list) and bool(p) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                   for m in p)


def load_rows(source: str, split: str, prompt_column: str, answer_column: str | None,
              image_column: str | None = None):
    """Rows as dicts with 'prompt', 'answer' (may be None) and the other columns.
    source: 'builtin:arith', 'builtin:multiply', 'builtin:squares' or 'builtin:carries', a local
    .jsonl/.json/.parquet file, or a hub dataset id. A built-in
    task is one fixed set of problems, whatever --seed (which orders and samples them): the
    shipped tiny model's warm start never saw its eval split.
    image_column: each row's image or list of images ('auto': 'images' if the dataset has that
    column, else 'image', else none; None: no images). Such rows get 'images' (uint8 [H, W, 3]
    arrays, models/vision.py read_image; a path may be relative to the dataset file's folder) and a
    prompt of chat messages with one {"type": "image"} part per image."""
    root = None  # where relative image paths start
    if source in TASKS:
        rows = TASKS[source]("eval" if split in ("eval", "test") else "train")
        prompt_column, answer_column = "prompt", "answer"
        image_column = "images" if "images" in rows[0] else None
    else:
        ds = read_dataset(source, split)
        if prompt_column not in ds.column_names:
            raise UserError(f"dataset {source!r} has no prompt column {prompt_column!r}; its columns are "
                            f"{ds.column_names}: pass --prompt-column with one of them")
        if answer_column and answer_column not in ds.column_names:
            raise UserError(f"dataset {source!r} has no answer column {answer_column!r}; its columns are "
                            f"{ds.column_names}: pass --answer-column with one of them (or None: no answers)")
        image_column = pick_image_column(source, ds.column_names, image_column)
        if os.path.exists(source):
            root = os.path.dirname(os.path.abspath(source))
        rows = ds.to_list()
    if not rows:
        raise UserError(f"dataset {source!r} (split {split!r}) is empty")
    out = []
    for i, r in enumerate(rows):
        p = r.get(prompt_column)
        if not is_prompt(p):
            raise UserError(f"dataset {source!r} row {i}: column {prompt_column!r} must be a non-empty "
                            f"string or a list of {{'role', 'content'}} messages, got {str(p)[:80]!r}")
        if answer_column is not None and not isinstance(r[answer_column], (str, int, float)):
            raise UserError(f"dataset {source!r} row {i}: column {answer_column!r} must be a string or a "
                            f"number, got {str(r[answer_column])[:80]!r}")
        extra = {k: v for k, v in r.items() if k not in (prompt_column, answer_column, image_column)}
        row = {"prompt": p, "answer": None if answer_column is None else str(r[answer_column]), **extra}
        if image_column is not None:
            where = f"dataset {source!r} row {i}"
            row["images"] = vision.row_images(r[image_column], root, where)
            if row["images"]:
                row["prompt"] = vision.with_image_parts(p, len(row["images"]), where)
        out.append(row)
    return out


def pick_image_column(source: str, columns: list[str], image_column: str | None) -> str | None:
    """--image-column: 'auto' is 'images', else 'image', else None (no images); a name the
    dataset has not is a UserError."""
    if image_column == "auto":
        return next((c for c in ("images", "image") if c in columns), None)
    if image_column is not None and image_column not in columns:
        raise UserError(f"dataset {source!r} has no image column {image_column!r}; its columns are "
                        f"{columns}: pass --image-column with one of them (auto: 'images' or 'image' if "
                        "there is one)")
    return image_column


def _unreadable(source: str, ext: str, error: Exception) -> str:
    """Why `datasets` could not read a file, as the line or row at fault: pyarrow's own message
    names neither (a malformed JSON line shows up as a column type error)."""
    if ext == "parquet":
        return f"dataset file {source!r} is not a readable parquet file ({type(error).__name__}: {error})"
    with open(source) as f:
        text = f.read()
    if ext == "json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            return f"dataset file {source!r} line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
        lines = list(enumerate(rows))  # a JSON array: rows counted from 0
        where = "row"
    else:
        lines = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                lines.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                return f"dataset file {source!r} line {number}: not valid JSON ({e.msg}, column {e.colno})"
        where = "line"
    first = {}  # column -> (line, type) where it first appears
    for number, row in lines:
        if not isinstance(row, dict):
            return (f"dataset file {source!r} {where} {number}: a row must be a JSON object, got "
                    f"{str(row)[:60]!r}")
        for column, value in row.items():
            if value is None:
                continue
            if column not in first:
                first[column] = (number, type(value).__name__)
            elif first[column][1] != type(value).__name__:
                seen, kind = first[column]
                return (f"dataset file {source!r} {where} {number}: column {column!r} is a "
                        f"{type(value).__name__} here but a {kind} in {where} {seen}: give every row the "
                        "same type")
    return f"could not read dataset file {source!r}: {type(error).__name__}: {error}"


def tokenize_rows(rows, tok: Tokenizer, max_prompt_tokens: int, tools: list | None = None):
    """Adds 'text' and 'ids' to each row; rows whose prompt is longer than the limit are
    dropped. A row's 'prompt_messages' (an environment's opening, engines/episodes.py) are rendered
    instead of its prompt, with `tools` (schemas) for the template. A row with 'images' gets an
    ImagePrompt (models/vision.py): its <|image_pad|> expanded to each image's tokens, and it is
    dropped whole when those make it too long, never cut. Returns (kept rows, number skipped)."""
    kept, skipped = [], 0
    images = None  # the tokenizer's vision.ImageTokens, made at the first row with images
    image_skips, shortest = 0, None  # rows with images over the limit; the fewest ids among them
    for r in rows:
        if r.get("images") and images is None:
            images = vision.ImageTokens(tok)
        text, special = tok.render(r.get("prompt_messages", r["prompt"]), tools)
        ids = tok.encode(text, special)
        if r.get("images"):
            ids = images.prompt(ids, r["images"])
        if len(ids) > max_prompt_tokens:
            skipped += 1
            if r.get("images"):
                image_skips += 1
                shortest = min(len(ids), shortest or len(ids))
            continue
        kept.append({**r, "text": text, "ids": ids})
    if image_skips and kept:
        warnings.warn(f"{image_skips} of {len(rows)} prompts with images are longer than "
                      f"--max-prompt-tokens={max_prompt_tokens} with their image tokens (the shortest of "
                      f"them: {shortest}) and are skipped: raise --max-prompt-tokens to keep them",
                      stacklevel=2)
    if not kept and image_skips:
        raise UserError(f"every prompt is longer than --max-prompt-tokens={max_prompt_tokens} with its image "
                        f"tokens (the shortest: {shortest}); raise --max-prompt-tokens to {shortest} or more")
    if not kept:
        raise UserError(f"every prompt is longer than --max-prompt-tokens={max_prompt_tokens}; raise it")
    return kept, skipped


# ---------------------------------------------------------------- preference pairs (train_rm.py)

def wrong_answer(answer: str, rng: random.Random) -> str:
    """A plausible wrong sum, never the answer: half the time a slip of 1, 2 or 10 (one digit
    off), else any sum two 2-digit numbers can have."""
    right = int(answer)
    while True:
        if rng.random() < 0.5:
            wrong = right + rng.choice([-10, -2, -1, 1, 2, 10])
        else:
            wrong = rng.randrange(199)
        if wrong >= 0 and wrong != right:
            return str(wrong)


def arith_pairs(split: str) -> list[dict]:
    """The built-in task as preference pairs: its right answer beats a wrong one. One fixed
    wrong answer per problem (as load_rows, the same pairs whatever --seed)."""
    rng = random.Random(f"arith-pairs-{split}")
    return [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": wrong_answer(r["answer"], rng)}
            for r in arith_rows(split)]


def load_pairs(source: str, split: str, chosen_column: str, rejected_column: str,
               prompt_column: str | None) -> list[dict]:
    """Preference pairs as dicts with 'prompt' (None without a prompt column: chosen and rejected
    are then whole texts), 'chosen' and 'rejected'. source: as load_rows."""
    if source == BUILTIN:
        return arith_pairs("eval" if split in ("eval", "test") else "train")
    ds = read_dataset(source, split)
    for flag, column in (("chosen", chosen_column), ("rejected", rejected_column), ("prompt", prompt_column)):
        if column is not None and column not in ds.column_names:
            raise UserError(f"dataset {source!r} has no {flag} column {column!r}; its columns are "
                            f"{ds.column_names}: pass --{flag}-column with one of them")
    rows = ds.to_list()
    if not rows:
        raise UserError(f"dataset {source!r} (split {split!r}) is empty")
    out = []
    for i, r in enumerate(rows):
        prompt = None
        if prompt_column is not None:
            prompt = r[prompt_column]
            if not is_prompt(prompt):
                raise UserError(f"dataset {source!r} row {i}: column {prompt_column!r} must be a non-empty "
                                "string or a list of {'role', 'content'} messages, got "
                                f"{str(prompt)[:80]!r}")
        for column in (chosen_column, rejected_column):
            if not (isinstance(r[column], str) and r[column]):
                raise UserError(f"dataset {source!r} row {i}: column {column!r} must be a non-empty string, "
                                f"got {str(r[column])[:80]!r}")
        out.append({"prompt": prompt, "chosen": r[chosen_column], "rejected": r[rejected_column]})
    return out


def tokenize_pairs(pairs, tok: Tokenizer, max_tokens: int):
    """Adds 'ids' (the prompt's tokens) and 'chosen_ids' / 'rejected_ids' (each answer's, then
    EOS) to each pair, tokenised apart as the policy makes them (its samples follow the prompt's
    tokens); pairs whose prompt + longer answer exceed max_tokens are dropped. Without a prompt,
    'ids' is empty and the answers are whole texts. Returns (kept pairs, number skipped)."""
    eos = [min(tok.eos_ids)] if tok.eos_ids else []
    kept, skipped = [], 0
    for p in pairs:
        ids, special = [], True
        if p["prompt"] is not None:
            text, special = tok.render(p["prompt"])
            ids, special = tok.encode(text, special), False
        chosen = tok.encode(p["chosen"], special) + eos
        rejected = tok.encode(p["rejected"], special) + eos
        if len(ids) + max(len(chosen), len(rejected)) > max_tokens:
            skipped += 1
            continue
        kept.append({**p, "ids": ids, "chosen_ids": chosen, "rejected_ids": rejected})
    if not kept:
        raise UserError(f"every pair is longer than --max-tokens={max_tokens}; raise it")
    return kept, skipped


def step_indices(n_rows: int, step: int, batch: int, seed: int) -> list[int]:
    """The global batch of step `step`: row indices from a per-epoch shuffle (stateless, so
    resuming at a step needs no loader state)."""
    out = []
    start = step * batch
    while len(out) < batch:
        epoch, offset = divmod(start + len(out), n_rows)
        order = list(range(n_rows))
        random.Random(f"{seed}-epoch-{epoch}").shuffle(order)
        out.extend(order[offset:offset + batch - len(out)])
    return out


def step_prompts(rows: list[dict], step: int, per_step: int, seed: int, rank: int, dp: int):
    """This rank's rows of `step` and their sampling seeds: per (seed, step, position in the
    step's global batch), never per rank, so that the samples do not depend on the placement.
    Each rank takes its own slice: no rank gathers the batch."""
    batch = step_indices(len(rows), step, per_step, seed)
    mine = rank_slice(list(enumerate(batch)), rank, dp)
    return [rows[i] for _, i in mine], [prompt_seed(seed, step, pos) for pos, _ in mine]


class PromptStream:
    """One trainer rank's own prompts under dynamic sampling, where each rank draws as many as
    its waves need: rank r takes positions r, r + dp, r + 2 dp, ... of the same per-epoch
    shuffles as `step_indices`, so no rank gathers anything and the order depends on the seed
    and the trainer count only. Prompts put back (an informative group beyond the step's
    target, G-Core's buffer) are drawn first. `state` / `load` carry it through a checkpoint."""

    def __init__(self, n_rows: int, seed: int, rank: int, dp: int):
        self.n_rows, self.seed, self.rank, self.dp = n_rows, seed, rank, dp
        self.cursor = 0  # prompts drawn from the data so far
        self.buffer = []  # row indices put back, drawn first
        self.epoch, self.order = -1, []  # the shuffle of the current epoch

    def take(self, k: int) -> list[int]:
        """The next k row indices: the buffer's first, then the data's."""
        out, self.buffer = self.buffer[:k], self.buffer[k:]
        while len(out) < k:
            epoch, offset = divmod(self.rank + self.cursor * self.dp, self.n_rows)
            if epoch != self.epoch:
                self.epoch, self.order = epoch, list(range(self.n_rows))
                random.Random(f"{self.seed}-epoch-{epoch}").shuffle(self.order)
            out.append(self.order[offset])
            self.cursor += 1
        return out

    def put_back(self, indices: list[int]):
        self.buffer.extend(indices)

    def state(self) -> dict:
        return {"cursor": self.cursor, "buffer": list(self.buffer)}

    def load(self, state: dict):
        self.cursor, self.buffer = state["cursor"], list(state["buffer"])


def per_sample(values: list, n: int) -> list:
    """One value per prompt -> one per completion (prompt-major, as the engines return them)."""
    return [v for v in values for _ in range(n)]


def dataset_columns(rows: list[dict], n: int) -> dict[str, list]:
    """The rows' dataset columns other than the prompt (the answer, tests, ...), one value per
    completion: what reward functions get as keyword arguments."""
    columns = {}
    for key in rows[0]:
        if key not in ("prompt", "text", "ids", "prompt_messages"):
            columns[key] = per_sample([r.get(key) for r in rows], n)
    return columns


def eval_source(dataset: str, eval_dataset: str | None) -> str | None:
    """Where held-out prompts come from: --eval-dataset, else the built-in task's eval split,
    else a hub id's test split; a local file has none."""
    if eval_dataset is not None:
        return eval_dataset
    if dataset in TASKS or not os.path.exists(dataset):
        return dataset
    return None


def rank_slice(items: list, rank: int, world: int) -> list:
    if len(items) % world:
        raise UserError(f"the global batch of {len(items)} prompts does not split over {world} ranks; "
                        f"make --prompts-per-step a multiple of {world}")
    per = len(items) // world
    return items[rank * per:(rank + 1) * per]


def prompt_seed(seed: int, step: int, index: int, wave: int | None = None) -> int:
    """A 31-bit seed for one prompt of the global batch (of one wave, with dynamic sampling):
    the same on any rank or placement."""
    if wave is None:
        return random.Random(f"{seed}-{step}-{index}").getrandbits(31)
    return random.Random(f"{seed}-{step}-wave{wave}-{index}").getrandbits(31)


class Batch(TypedDict, total=False):
    """One rank's training rows, one per completion: the names used in every file.

        input_ids   [N, P+T] long   left-padded prompt, then the completion, right-padded
        valid       [N, P+T] bool   attention mask: False on padding
        prompt_len  int             P: completion token t sits at column P + t
        loss_mask   [N, T]   float  1 on completion tokens (what the loss sees), 0 on padding
        old_logp    [N, T]   float  the old policy's log-prob of each sampled token (the ratio's
                                    denominator): the engine's, or the trainer's with --recompute-old-logp
        engine_logp [N, T]   float  the engine's, kept apart when the trainer recomputed old_logp
        is_weight   [N, T]   float  the mismatch correction's weight on each token's loss (--mismatch)
        ref_logp    [N, T]   float  the reference policy's log-prob (only with a KL term)
        adv         [N, T]   float  advantage per completion token (GRPO: its completion's, broadcast)
        values      [N, T]   float  PPO: the critic's value of each state, at rollout
        returns     [N, T]   float  PPO: GAE's returns, the critic's target
    """
    input_ids: "torch.Tensor"
    valid: "torch.Tensor"
    prompt_len: int
    loss_mask: "torch.Tensor"
    old_logp: "torch.Tensor"
    engine_logp: "torch.Tensor"
    is_weight: "torch.Tensor"
    ref_logp: "torch.Tensor"
    adv: "torch.Tensor"
    values: "torch.Tensor"
    returns: "torch.Tensor"


def make_batch(prompts: list[list[int]], tokens, lengths, pad_id: int, device="cpu",
               model_mask=None, routes: list | None = None) -> Batch:
    """The training batch of a rank's samples (input_ids, valid, prompt_len, loss_mask of
    `Batch`). prompts: one id list per row; tokens [N, T], lengths [N] from the engine;
    model_mask [N, T] (episodes): 0 on the environment's tokens, which leave the loss; routes (a
    MoE model's experts, Samples.routes): per row [len(prompt) + length, layers, k], laid out as
    input_ids are ("routes" [N, P+T, layers, k], -1 on padding)."""
    import torch

    N, T = tokens.shape
    P = max(map(len, prompts))
    input_ids = torch.full((N, P + T), pad_id, dtype=torch.long)
    valid = torch.zeros(N, P + T, dtype=torch.bool)
    for i, p in enumerate(prompts):
        input_ids[i, P - len(p):P] = torch.tensor(p)
        valid[i, P - len(p):P] = True
    completion = torch.arange(T)[None] < lengths[:, None]  # [N, T]
    input_ids[:, P:] = torch.where(completion, tokens, pad_id)
    valid[:, P:] = completion
    loss_mask = completion.float() if model_mask is None else completion * model_mask
    batch = {"input_ids": input_ids.to(device), "valid": valid.to(device), "prompt_len": P,
             "loss_mask": loss_mask.to(device)}
    if routes:  # (a rank's empty batch has none)
        batch["routes"] = torch.full((N, P + T, *routes[0].shape[1:]), -1, dtype=torch.int16)
        for i, (p, r) in enumerate(zip(prompts, routes)):
            batch["routes"][i, P - len(p):P - len(p) + len(r)] = r
        batch["routes"] = batch["routes"].to(device)
    if any(getattr(p, "images", None) for p in prompts):  # a vision-language model's (models/vision.py)
        # per row: (patches [n, 1176], grids [k, 3]), made once per prompt and shared by its samples'
        # rows (the tower then runs once per image: models/qwen2_vl.py images_of); None: no image
        made = {}
        for p in prompts:
            if getattr(p, "images", None) and id(p) not in made:
                made[id(p)] = (p.patches().to(device), torch.tensor(p.grids, device=device))
        batch["images"] = [made.get(id(p)) for p in prompts]
    return batch


def take_rows(batch: dict, rows) -> dict:
    """Rows of a batch dict (a slice or an index tensor): tensors with a leading row dimension
    and lists of one entry per row (a row's images) are indexed, the rest kept."""
    import torch

    N = batch["input_ids"].shape[0]

    def take(v):
        if torch.is_tensor(v) and v.dim() and v.shape[0] == N:
            return v[rows]
        if isinstance(v, list) and len(v) == N:  # rows: a slice, indices, or a bool mask
            index = torch.as_tensor(rows) if not isinstance(rows, slice) else None
            if index is not None and index.dtype == torch.bool:
                index = index.nonzero()[:, 0]
            return v[rows] if index is None else [v[i] for i in index.tolist()]
        return v
    return {k: take(v) for k, v in batch.items()}


def micro_batches(batch: dict, size: int):
    """Consecutive row slices of a batch dict, `size` rows each."""
    for s in range(0, batch["input_ids"].shape[0], size):
        yield take_rows(batch, slice(s, s + size))


def forward_batches(batch: dict, size: int, tokens: int = 0, group=None):
    """Micro-batches for the forward and backward passes, `size` rows each, without the columns
    that are padding in every row of one: with more than one micro-batch the rows go longest
    completion first (a stable sort), so each holds rows of like length, and each is cut to its own
    longest prompt and completion. Yields (rows, micro-batch): rows, the indices [n] of its rows in
    `batch`; a per-row result [n, T'] goes back with `scatter_rows`. One micro-batch is the batch
    itself (the engine already cut T to its longest completion); a vision-language batch is sliced
    as `micro_batches` does (its M-RoPE positions are made over the whole width).

    tokens > 0 (--micro-batch-tokens): micro-batches of at most that many tokens (and `size` rows),
    each packed into one sequence without padding, a prompt once for all of its rows in the
    micro-batch (models/packing.py; its "packed" entry). group: the ranks that run these forwards
    together (FSDP): every one then runs as many micro-batches, the most any of them needs."""
    import torch

    N, P = batch["input_ids"].shape[0], batch["prompt_len"]
    if tokens and "images" not in batch:
        yield from _packed_batches(batch, size, tokens, group)
        return
    if N <= size or "images" in batch:
        for s in range(0, N, size):
            yield torch.arange(s, min(s + size, N)), take_rows(batch, slice(s, s + size))
        return
    lengths = batch["valid"][:, P:].sum(-1)  # [N]: a completion is a prefix of its columns
    order = torch.sort(lengths, descending=True, stable=True).indices  # [N]
    for s in range(0, N, size):
        rows = order[s:s + size]
        yield rows, _cut_columns(take_rows(batch, rows))


def _cut_columns(mb: dict) -> dict:
    """A micro-batch without the columns that are padding in all of its rows: from its first prompt
    column to its longest completion's end (prompt_len moves with the cut)."""
    import torch

    P = mb["prompt_len"]
    T = mb["input_ids"].shape[1] - P
    first = int(mb["valid"][:, :P].any(0).int().argmax())  # the first column any prompt uses
    longest = max(1, int(mb["valid"][:, P:].sum(-1).max()))  # the last column any completion uses, + 1

    def cut(k, v):
        if k in ("input_ids", "valid", "routes"):
            return v[:, first:P + longest]  # [n, P - first + longest]
        if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == T:
            return v[:, :longest]  # [n, longest]: loss_mask, old_logp, adv, ...
        return v
    return {**{k: cut(k, v) for k, v in mb.items()}, "prompt_len": P - first}


def _packed_batches(batch: dict, size: int, tokens: int, group):
    """forward_batches with a token budget: rows planned into bins (models.packing.plan_bins, a
    group's rows together), as many bins as the group's busiest rank, each cut and packed."""
    import torch

    P, valid = batch["prompt_len"], batch["valid"]
    keys = prompt_keys(batch["input_ids"], valid, P)  # [N]
    lengths = valid.sum(-1)  # [N]
    prompt_lens = valid[:, :P].sum(-1)  # [N]
    bins = plan_bins(keys.tolist(), prompt_lens.tolist(), (lengths - prompt_lens).tolist(), tokens, size)
    most = len(bins)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        most = int(reduce({"bins": len(bins)}, op=torch.distributed.ReduceOp.MAX, group=group)["bins"])
        bins = split_to(bins, most)
    for rows in bins:
        rows = torch.tensor(rows)  # on the CPU, as the padded path's: it indexes results on any device
        mb = _cut_columns(take_rows(batch, rows))
        yield rows, {**mb, "packed": pack(mb["input_ids"], mb["valid"], mb["prompt_len"], keys[rows],
                                          mb.get("routes"))}
    for _ in range(most - len(bins)):  # too few rows here to split into as many: forwards that count nothing
        yield _idle(batch)


def _idle(batch: dict):
    """A micro-batch that pairs another rank's FSDP forward and backward and adds nothing: the first
    row with every token out of the loss, for no row (rows is empty: its results go nowhere)."""
    import torch

    if not len(batch["input_ids"]):
        raise UserError("a trainer rank holds no rows while another runs micro-batches: every rank needs "
                        "rows to run the same forwards (FSDP)")
    mb = _cut_columns(take_rows(batch, slice(0, 1)))
    mb = {**mb, "loss_mask": torch.zeros_like(mb["loss_mask"]),
          "packed": pack(mb["input_ids"], mb["valid"], mb["prompt_len"], torch.zeros(1, dtype=torch.long),
                         mb.get("routes"))}
    return torch.zeros(0, dtype=torch.long), mb


def scatter_rows(parts, N: int, T: int):
    """[N, T] from forward_batches' (rows, result [n, T']) pairs; 0 on the columns cut off."""
    import torch

    first = parts[0][1]
    out = torch.zeros(N, T, dtype=first.dtype, device=first.device)
    for rows, x in parts:
        out[rows.to(x.device), :x.shape[1]] = x
    return out
