"""The tokenizer: a Hugging Face tokenizer.json (the `tokenizers` library, no transformers) with its
chat template, and the offline training of the tiny tokenizers the built-in tasks use.
"""
import json
import os

from tokenizers import Tokenizer as HFTokenizer

from models.config import read_json
from utils.errors import UserError

EOS = "<|endoftext|>"


def check_same_tokenizer(path: str, flag: str, policy: str, why: str):
    """A model that reads the policy's token ids (the critic, a reward model) must share its
    vocabulary, token for id; else one error naming both directories and `why` it must."""
    try:
        mine = Tokenizer(path).tok.get_vocab(with_added_tokens=True)
    except FileNotFoundError:
        mine = None
    if mine != Tokenizer(policy).tok.get_vocab(with_added_tokens=True):
        has = "no tokenizer.json, not the tokenizer of" if mine is None else "another tokenizer than"
        raise UserError(f"{flag} {path} has {has} --model {policy}: {why}")


class Tokenizer:
    """tokenizer.json via the `tokenizers` library, plus tokenizer_config.json's special
    tokens and chat template (rendered with jinja2, as transformers does)."""

    def __init__(self, path: str):
        self.path, file = path, os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{path!r} has no tokenizer.json (a fast tokenizer is required)")
        try:
            self.tok = HFTokenizer.from_file(file)
        except Exception as e:  # the tokenizers library's own error: a broken or foreign file
            raise UserError(f"{file} is not a readable tokenizer ({e})") from None
        conf = {}
        if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            conf = read_json(os.path.join(path, "tokenizer_config.json"))
        self.chat_template, self._template = conf.get("chat_template"), None
        if self.chat_template is None and os.path.isfile(os.path.join(path, "chat_template.jinja")):
            with open(os.path.join(path, "chat_template.jinja")) as f:
                self.chat_template = f.read()
        tokname = lambda t: t.get("content") if isinstance(t, dict) else t  # noqa: E731
        self.eos_token, self.bos_token = tokname(conf.get("eos_token")), tokname(conf.get("bos_token"))
        self.eos_ids = set()
        if self.eos_token and self.tok.token_to_id(self.eos_token) is not None:
            self.eos_ids.add(self.tok.token_to_id(self.eos_token))
        for name in ("config.json", "generation_config.json"):  # HF lists extra stop ids here
            if os.path.isfile(os.path.join(path, name)):
                eos = read_json(os.path.join(path, name)).get("eos_token_id")
                self.eos_ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        pad = tokname(conf.get("pad_token"))
        self.pad_id = self.tok.token_to_id(pad) if pad else None
        if self.pad_id is None:
            self.pad_id = min(self.eos_ids) if self.eos_ids else 0

    def encode(self, text: str, special: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def decode_batch(self, batch) -> list[str]:
        return self.tok.decode_batch([list(x) for x in batch], skip_special_tokens=True)

    def render(self, prompt, tools: list | None = None) -> tuple[str, bool]:
        """Prompt (a string or a list of chat messages) -> (text, whether special tokens are
        still to be added by encode). The chat template is applied when the tokenizer has one;
        `tools`: tool schemas (tasks.env.schema) for the template."""
        if self.chat_template is None and (not isinstance(prompt, str) or tools):
            raise UserError(f"a prompt is a list of chat messages (or offers tools), but the tokenizer in "
                            f"{self.path} has no chat template (tokenizer_config.json's chat_template, or "
                            "chat_template.jinja): add one there, or give --prompt-column a column of "
                            "strings")
        if self.chat_template is None:
            return prompt, True
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.chat(messages, True, tools), False  # the template already holds the special tokens

    def chat(self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None) -> str:
        """The chat template's text of `messages` (rendered with jinja2, as transformers does)."""
        if self._template is None:  # compiled once
            import jinja2

            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(msg):
                raise UserError(msg)

            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = _tojson  # transformers' (jinja's own escapes HTML)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools or None,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def train_tokenizer(texts, path: str, vocab_size: int = 512, chat_template: str | None = None,
                    special: tuple = (), added: tuple = ()):
    """A byte-level BPE tokenizer trained offline in well under a second; digits stay single
    tokens so that arithmetic is learnable. `special`: special tokens besides EOS (skipped when
    decoding); `added`: whole tokens that decode as text (tags such as <tool_call>). Writes
    tokenizer.json + tokenizer_config.json."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, *special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if added:
        from tokenizers import AddedToken

        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS,
            "model_max_length": 2048}
    if chat_template:
        conf["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    return tok.token_to_id(EOS)
