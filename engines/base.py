"""The engines' one small interface, which the rollout (and any role that generates) builds on:

    engine.load_weights(iter of (hf_name, tensor))   replace the weights in place (copy each tensor
                                                     before asking for the next: it may be reused)
    engine.generate(prompt_ids, params, seeds)    -> Samples (n per prompt, prompt-major)
    engine.release()                                 free weights and cache (colocate, before training)
    engine.submit(...) -> ticket; engine.result(ticket)   generate, possibly in the background
    engine.collect()                                 wait for everything submitted (a no-op here)
    engine.version                                   the policy version of the loaded weights

`engines/native.py` `NativeEngine` and `engines/vllm_engine.py` `VLLMEngine` implement it (and
`engines/tp.py` `TPEngine`, `engines/episodes.py` `Episodes`, `roles.rollout.RemoteEngine`);
`engines/make.py` `make_engine` picks one for the flags.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class Samples:
    """n completions per prompt, prompt-major: row i*n + j is sample j of prompt i."""
    tokens: torch.Tensor  # [N, T] long, padded with 0 after each length
    logprobs: torch.Tensor  # [N, T] fp32 log-prob of each sampled token (temperature applied)
    lengths: torch.Tensor  # [N] long
    finish_reasons: list  # "stop" (EOS or stop string) | "length"
    texts: list  # decoded completions (stop string cut off)
    version: int = 0  # the policy version (optimizer steps) of the weights that generated them
    # multi-turn episodes (engines/episodes.py) only; None / empty for single-turn samples
    model_mask: torch.Tensor | None = None  # [N, T] 1 on the model's tokens, 0 on the environment's
    # [N, T] long: the policy version of each token (-1: an environment's, or past the length); multi-turn
    # episodes and --stream (a sample's tokens may span versions: engines/pool.py)
    token_versions: torch.Tensor | None = None
    episode: dict = field(default_factory=dict)  # {stat: [N] float} turns, tool calls, errors, stops
    transcripts: list | None = None  # the whole episode's text (the judge reads it)
    # a MoE model's experts with --routing-replay (models/moe.py Recorder): per sample, int16
    # [len(prompt) + length, layers, k], the prompt's tokens then the completion's (-1: not recorded)
    routes: list | None = None
    # --agent episodes (engines/agents.py): per sample, the prompt ids its agent's first request rendered
    prompts: list | None = None

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
                       None if self.transcripts is None else [self.transcripts[i] for i in rows],
                       None if self.routes is None else [self.routes[i] for i in rows],
                       None if self.prompts is None else [self.prompts[i] for i in rows])

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
                       torch.cat([pad(p.token_versions, -1) for p in parts if p.token_versions is not None])
                       if all(p.token_versions is not None or not len(p.lengths) for p in parts)
                       and any(p.token_versions is not None for p in parts) else None,
                       {k: torch.cat([p.episode[k] for p in turns]) for k in turns[0].episode}
                       if turns else {},
                       [t for p in turns for t in p.transcripts] if turns else None,
                       [r for p in parts for r in p.routes or []]
                       if all(p.routes is not None or not len(p.lengths) for p in parts) else None,
                       [r for p in parts for r in p.prompts or []]
                       if all(p.prompts is not None or not len(p.lengths) for p in parts) else None)


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
