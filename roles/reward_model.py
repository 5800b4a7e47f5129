"""A Bradley-Terry reward model: a HF sequence-classification checkpoint
(Qwen2ForSequenceClassification / LlamaForSequenceClassification: the decoder plus a one-score
`score` head, `pad_token_id` in config.json) loaded with our model code, sharded like the
other roles, frozen. It scores each whole sequence at its last non-pad token, as transformers
does. `train_rm.py` trains one on preference pairs.

It reads the token ids the policy generated, so it must share the policy's tokenizer."""

import torch

from models.decoder import sequence_scores
from models.hf import check_model_dir, read_config
from models.packing import token_budget
from models.parallelize import load_sharded
from models.tokenizer import check_same_tokenizer
from tasks.data import forward_batches
from utils.errors import UserError


def check(path: str, policy: str):
    """A checkpoint the reward-model role can use with this policy, else a UserError saying why."""
    check_model_dir(path, "--reward-model")
    try:
        cfg = read_config(path)
    except FileNotFoundError as e:
        raise UserError(f"--reward-model: {e}") from None
    if not cfg.scores:
        raise UserError(f"--reward-model {path} is a {cfg.architecture}: use a ...ForSequenceClassification "
                        "checkpoint (train_rm.py trains one)")
    if cfg.num_labels != 1:
        raise UserError(f"--reward-model {path} has {cfg.num_labels} labels: a reward model has one score")
    if cfg.pad_token_id is None:
        raise UserError(f"--reward-model {path}: config.json has no pad_token_id (a sequence-classification "
                        "model scores the last non-pad token): add the tokenizer's pad id to it")
    check_same_tokenizer(path, "--reward-model", policy, "it reads the policy's token ids, so train it from "
                         "the policy's tokenizer (train_rm.py --model)")


class RewardModel:
    def __init__(self, path: str, mesh, device, param_dtype=torch.float32, micro_batch_size: int = 64,
                 micro_batch_tokens: int = 0):
        self.model = load_sharded(path, mesh, device, param_dtype).requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = token_budget(self.model, micro_batch_tokens)  # tasks.data.forward_batches
        self.group = mesh.get_group()

    @torch.no_grad()
    def score(self, batch):
        """[N] (on the CPU): the score of each prompt + completion of a tasks.data.Batch, its
        micro-batches cut to the columns their rows use (tasks.data.forward_batches)."""
        scores = torch.empty(len(batch["input_ids"]))  # [N]
        for rows, mb in forward_batches(batch, self.micro_batch_size, self.micro_batch_tokens, self.group):
            scores[rows] = sequence_scores(self.model, mb).float().cpu()
        return scores
