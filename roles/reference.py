"""The frozen reference policy for the KL term, sharded like the actor. Not built when kl_coef = 0.
The distillation teacher (roles/teacher.py) is this class on another checkpoint."""
import torch
from torch.distributed.tensor import DTensor

from models.decoder import completion_logprobs
from models.packing import token_budget
from models.parallelize import load_sharded
from tasks.data import forward_batches, scatter_rows


class Reference:
    def __init__(self, path: str, mesh, device, param_dtype=torch.float32, temperature: float = 1.0,
                 micro_batch_size: int = 64, releases: bool = False, micro_batch_tokens: int = 0):
        self.model = load_sharded(path, mesh, device, param_dtype).requires_grad_(False)
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = token_budget(self.model, micro_batch_tokens)  # tasks.data.forward_batches
        self.group = mesh.get_group()
        self.releases = releases  # between uses its shards leave the device (`release`, `load`)
        self.shards: list = []  # the storages of this rank's shards, and their copies in host memory
        self.host: list[torch.Tensor] = []

    @torch.no_grad()
    def logprobs(self, batch):
        """ref_logp [N, T]: log-probs of the completion tokens under the reference policy."""
        self.load()
        logp = scatter_rows([(rows, completion_logprobs(self.model, mb, self.temperature))
                             for rows, mb in forward_batches(batch, self.micro_batch_size,
                                                             self.micro_batch_tokens, self.group)],
                            *batch["loss_mask"].shape)  # [N, T]
        self.release()
        return logp

    def release(self):
        """Frees this rank's shards on the device until the next `load`: a copy in host memory (made
        the first time only, since the weights never change: pinned on a GPU) keeps them, and each
        storage is resized to 0 bytes, so the module, its DTensors and FSDP2's views stay as they are
        (FSDP2's own trick for its unsharded buffers). Nothing when built without `releases`."""
        if not self.releases:
            return
        if not self.shards:  # after the first forward: FSDP2 has re-padded its shards by then
            local = [p.to_local() if isinstance(p, DTensor) else p for p in self.model.parameters()]
            self.shards = list({t.untyped_storage().data_ptr(): t.untyped_storage()
                                for t in local if t.untyped_storage().nbytes()}.values())
            pin = self.shards[0].device.type == "cuda"
            self.host = [torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin) for s in self.shards]
            for h, s in zip(self.host, self.shards):
                h.untyped_storage().copy_(s)
        for s in self.shards:
            s.resize_(0)

    def load(self):
        """Gives the shards back their device memory and copies them in from the host."""
        for h, s in zip(self.host, self.shards):
            s.resize_(h.nbytes)
            s.copy_(h.untyped_storage(), non_blocking=True)
