"""Sharded training state with torch.distributed.checkpoint (DCP), saved atomically.

A checkpoint is a directory `run_dir/checkpoints/step_00000012/` (12 steps done) holding the DCP shards of
the model and optimizer (each rank writes its own; PPO's critic beside them), `rank{r}.json` with that
rank's RNG state, and `meta.json` (step, LR schedule, model shape) written last by rank 0. It is
written as `step_00000012.tmp/` and renamed only when complete, so a job killed while
saving leaves the previous checkpoint as the newest complete one. Tensors go through DCP,
the rest is JSON. DCP keeps its index (`.metadata`) as a pickle; we read it with an
unpickler that admits only DCP's own metadata classes, so a tampered checkpoint cannot
run code (DCP's non-tensor entries already load with torch.load(weights_only=True)).
"""
import base64
import io
import json
import os
import pickle
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from utils.errors import UserError

PREFIX = "step_"
SAFE_GLOBALS = {  # everything DCP's .metadata pickle refers to, and nothing else
    ("torch.distributed.checkpoint.metadata", None),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        dtype = module == "torch" and isinstance(getattr(__import__("torch"), name, None), torch.dtype)
        if dtype or (module, name) in SAFE_GLOBALS or (module, None) in SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a DCP index "
                                     "never holds: refusing to load it (was the checkpoint tampered with?)")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with the metadata pickle read by the restricted unpickler."""

    def read_metadata(self, *args, **kwargs):
        with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


TRAINED = StateDictOptions(ignore_frozen_params=True)


def _dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def checkpoint_dir(run_dir: str, step: int) -> str:
    """Where the checkpoint after `step` steps is (or would be)."""
    return os.path.join(_dir(run_dir), f"{PREFIX}{step:08d}")


def find(run_dir: str) -> tuple[str | None, list[str]]:
    """(newest complete checkpoint or None, partial ones that will be ignored)."""
    root = _dir(run_dir)
    if not os.path.isdir(root):
        return None, []
    complete, partial = [], []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith(PREFIX) and not name.endswith(".tmp") and is_complete(path):
            complete.append(path)
        elif name.startswith(PREFIX):
            partial.append(path)
    return (complete[-1] if complete else None), partial


def last_complete(run_dir: str) -> str:
    """Where the newest complete checkpoint is, said for a message."""
    path = find(run_dir)[0]
    if path is None:
        return "No checkpoint was saved."
    return f"The last complete checkpoint is {path}."


def newest_said(run_dir: str) -> str:
    """Where a lost peer leaves the run: its newest complete checkpoint, or none (flags.parse makes
    this utils.errors.newest_checkpoint)."""
    path = find(run_dir)[0]
    if path is None:
        return "No checkpoint was saved: a new launch starts afresh."
    return f"The newest complete checkpoint, {path}, is intact: --resume auto goes on from it."


def is_complete(path: str) -> bool:
    """A checkpoint directory that was written to the end (meta.json is written last), with the
    files meta.json awaits from other ranks (--stream: each rollout rank's work in flight, written
    when it takes this checkpoint's version: roles/stream.py)."""
    meta = os.path.join(path, "meta.json")
    if not os.path.isfile(meta):
        return False
    with open(meta) as f:
        awaits = json.load(f).get("awaits", [])
    return all(os.path.isfile(os.path.join(path, name)) for name in awaits)


def state(actor, critic=None) -> dict:
    """The tensors DCP saves and loads: the actor's model and optimizer, and the critic's. Frozen
    parameters are left out (LoRA's base: it is --model's, read at start)."""
    model_sd, optim_sd = get_state_dict(actor.model, actor.opt, options=TRAINED)
    # a tied head shares the (frozen) embedding, but DCP lists it under its own name: leave it out too
    frozen = {n for n, p in actor.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    state = {"model": {k: v for k, v in model_sd.items() if k not in frozen}, "optim": optim_sd}
    if critic is not None:
        model_sd, optim_sd = get_state_dict(critic.model, critic.opt)
        state.update(critic_model=model_sd, critic_optim=optim_sd)
    return state


def save(run_dir: str, step: int, actor, keep: int, rank: int, critic=None,
         extra: dict | None = None, rank_state: dict | None = None) -> dict:
    """Collective: every rank calls it after `step` steps are done; `extra` (JSON) goes into
    meta.json (PPO's KL coefficient), `rank_state` (JSON) into this rank's own file (its
    dynamic-sampling prompt stream). Returns seconds and the path."""
    t = time.perf_counter()
    final = checkpoint_dir(run_dir, step)
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier(group=actor.group)
    error = ""
    try:
        dcp.save(state(actor, critic), checkpoint_id=tmp, process_group=actor.group)
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
            json.dump({"torch_rng": rng, **(rank_state or {})}, f)
    except (OSError, CheckpointException) as e:  # a full disk, a quota: lose this save, not the run
        error = str(e).strip().splitlines()[-1][:300]
    failed = torch.tensor([float(bool(error))])
    # every rank must agree, or the next collective would split them
    dist.all_reduce(failed, group=actor.group)
    if failed.item():
        dist.barrier(group=actor.group)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        return {"seconds": time.perf_counter() - t, "path": None, "error": error or "failed on another rank"}
    if rank == 0:
        meta = {"step": step, "scheduler": actor.sched.state_dict(), "model": actor.config.to_hf(),
                "lora": _lora(actor), "freeze_vision": getattr(actor, "freeze_vision", False),
                "world": dist.get_world_size(actor.group), **(extra or {})}
        if critic is not None:
            meta.update(critic_scheduler=critic.sched.state_dict(), critic=critic.config.to_hf())
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f)
        if os.path.exists(final):  # the same step saved again (a resumed run): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        done = sorted(p for p in os.listdir(_dir(run_dir)) if p.startswith(PREFIX) and not p.endswith(".tmp"))
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(_dir(run_dir), old), ignore_errors=True)
    dist.barrier(group=actor.group)
    return {"seconds": time.perf_counter() - t, "path": final, "error": None}


def save_and_report(run_dir: str, step: int, actor, keep: int, rank: int, critic=None, extra=None,
                    rank_state=None):
    """`save`, and rank 0 says how it went; a failed save does not stop the run."""
    saved = save(run_dir, step, actor, keep, rank, critic, extra, rank_state)
    if rank != 0:
        return
    if saved["error"]:
        print(f"checkpoint after step {step} FAILED ({saved['error']}); the previous one "
              f"({find(run_dir)[0]}) is intact; training goes on", flush=True)
    else:
        print(f"saved {saved['path']} in {saved['seconds']:.2f}s", flush=True)


def _lora(actor) -> dict | None:
    """What a checkpoint's adapters are (their shapes and scale): a resume must ask for the same."""
    cfg = actor.lora
    return {"rank": cfg.lora_rank, "alpha": cfg.lora_alpha, "targets": cfg.lora_targets} if cfg else None


def _same_shape(path: str, theirs: dict, ours: dict, flag: str):
    shape_keys = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                  "image_size", "channels", "patch", "mlp_ratio",  # these 4: a flow model's
                  "vision_config")  # a Qwen2-VL's tower (its language model's keys are in text_config)
    theirs, ours = ({**d.get("text_config", {}), **d} for d in (theirs, ours))
    diff = {k: (theirs.get(k), ours.get(k)) for k in shape_keys if theirs.get(k) != ours.get(k)}
    if diff:
        raise UserError(f"checkpoint {path} is from a different model shape (checkpoint, {flag}): {diff}; "
                        f"resume with the {flag} it was trained from, or start a new --run-dir")


def _restore(role, model_sd, optim_sd, scheduler: dict):
    impl = [{k: g.get(k) for k in ("fused", "foreach")} for g in role.opt.param_groups]
    # strict=False: the frozen tensors are not in it (dcp.load checked every tensor that is, was read)
    set_state_dict(role.model, role.opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    for g, flags in zip(role.opt.param_groups, impl):  # how to step is ours, not the checkpoint's
        g.update(flags)  # (one saved before fused AdamW would turn it off)
    role.sched.load_state_dict(scheduler)


def load(path: str, actor, rank: int, critic=None) -> dict:
    """Collective: restores model and optimizer shards (the critic's too), LR schedules and RNG;
    returns meta, with this rank's own saved state under "rank_state" ({} if none)."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    _same_shape(path, meta["model"], actor.config.to_hf(), "--model")
    ours = _lora(actor)
    if meta.get("lora") != ours:
        raise UserError(f"checkpoint {path} was trained with LoRA {meta.get('lora')}, this run asks for "
                        f"{ours}: resume with the --lora-* flags it was trained with, or a new --run-dir")
    if meta.get("freeze_vision", False) != getattr(actor, "freeze_vision", False):  # frozen: not saved
        flag = "with --freeze-vision" if meta.get("freeze_vision") else "without --freeze-vision"
        raise UserError(f"checkpoint {path} was trained {flag}: resume {flag}, or start a new --run-dir")
    if critic is not None and "critic" not in meta:
        raise UserError(f"checkpoint {path} has no critic (a GRPO run's?): resume PPO from a PPO run's "
                        "checkpoint, or start a new --run-dir")
    if critic is not None:
        _same_shape(path, meta["critic"], critic.config.to_hf(), "--critic-model")
    tensors = state(actor, critic)
    dcp.load(tensors, storage_reader=SafeReader(path), process_group=actor.group)
    _restore(actor, tensors["model"], tensors["optim"], meta["scheduler"])
    if critic is not None:
        _restore(critic, tensors["critic_model"], tensors["critic_optim"], meta["critic_scheduler"])
    rank_file = os.path.join(path, f"rank{rank}.json")
    meta["rank_state"] = {}
    if os.path.isfile(rank_file):  # a different world size: ranks beyond the old one keep their seed
        with open(rank_file) as f:
            meta["rank_state"] = json.load(f)
        rng = base64.b64decode(meta["rank_state"].pop("torch_rng"))
        torch.set_rng_state(torch.frombuffer(bytearray(rng), dtype=torch.uint8))
    return meta


def restore(actor, carried: dict) -> dict:
    """A --rebalance move in process: the state it carried onto this rank's mesh (rebalance.move:
    `state`'s tensors, resharded, and the meta a checkpoint would hold), restored as `load`
    restores a checkpoint's. Returns the meta, with this rank's own saved state as "rank_state"."""
    model_sd, optim_sd = carried["state"]["model"], carried["state"]["optim"]
    params = dict(actor.model.named_parameters())  # a tied head is its embedding's, not listed again
    with torch.no_grad():
        for name, value in model_sd.items():
            if name in params:
                params[name].to_local().copy_(value.to_local())
    # Adam's moments are already this rank's shards on this mesh: the optimizer takes them as they are
    # (set_state_dict would copy them again: 2.5 s of a 100M model's move here)
    for name, moments in optim_sd["state"].items():
        actor.opt.state[params[name]] = dict(moments)
    for group, saved in zip(actor.opt.param_groups, optim_sd["param_groups"]):
        group.update({k: v for k, v in saved.items() if k not in ("params", "fused", "foreach")})
    actor.sched.load_state_dict(carried["meta"]["scheduler"])
    return {**carried["meta"], "rank_state": carried.get("rank_state", {})}


def resume(run_dir: str, how: str, actor, rank: int, critic=None) -> dict:
    """Continue from a checkpoint as --resume says; returns its meta.json, whose "step" is the
    steps already done ({"step": 0}: afresh).

    restart: the newest complete checkpoint in run_dir, only when torchrun has restarted the job
      (--max-restarts), so that a new launch into an old run_dir starts afresh;
    auto: the newest complete checkpoint in run_dir whenever there is one;
    none: never; anything else: the path of a checkpoint. Partial checkpoints are skipped."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    newest, partial = find(run_dir)
    looked = how == "auto" or (how == "restart" and restarted)  # in run_dir
    path = None
    if looked:
        path = newest
    elif how not in ("restart", "none"):
        path = how
    if rank == 0 and newest and not path:
        print(f"{run_dir} holds checkpoints of an earlier run: starting afresh (--resume auto continues it)",
              flush=True)
    if rank == 0 and looked and partial:
        print(f"ignoring incomplete checkpoint(s): {partial}", flush=True)
    if not path:
        return {"step": 0}
    meta = load(path, actor, rank, critic)
    if rank == 0:
        print(f"resumed from {path}: continuing at step {meta['step'] + 1}", flush=True)
    return meta


def digest(actor) -> str:
    """sha256 of the actor's full model and optimizer state (every tensor gathered whole, one at a
    time, in name order) and its learning rate: the same on every trainer, and across a change
    of sharding (a --rebalance move) only if the state came through exactly. Collective: every
    trainer joins the gathers, the first one hashes (the others would only share its cores) and
    tells them the digest."""
    import hashlib

    from torch.distributed.tensor import DTensor

    model_sd, optim_sd = get_state_dict(actor.model, actor.opt)
    first = dist.get_rank(actor.group) == 0
    h = hashlib.sha256()

    def walk(prefix: str, value):
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{prefix}/{key}", value[key])
        elif isinstance(value, torch.Tensor):
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if first:
                h.update(prefix.encode())
                h.update(full.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())

    walk("model", model_sd)
    walk("optim", optim_sd["state"])
    h.update(repr(actor.sched.get_last_lr()).encode())
    said = [h.hexdigest() if first else None]
    dist.broadcast_object_list(said, group=actor.group, group_src=0)
    return said[0]
