"""The frozen reference policy for the KL term, sharded like the actor. Not built when kl_coef = 0."""
import torch

from utils.data import micro_batches
from utils.dist import load_sharded
from utils.model import completion_logprobs


class Reference:
    def __init__(self, path: str, mesh, device, param_dtype=torch.float32, temperature: float = 1.0,
                 micro_batch_size: int = 64):
        self.model = load_sharded(path, mesh, device, param_dtype).requires_grad_(False)
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def logprobs(self, batch):
        """ref_logp [N, T]: log-probs of the completion tokens under the reference policy."""
        return torch.cat([completion_logprobs(self.model, mb, self.temperature)
                          for mb in micro_batches(batch, self.micro_batch_size)])
