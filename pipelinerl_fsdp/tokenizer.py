"""Tokenizers as HF folders (tokenizer.json + tokenizer_config.json, with chat template) that vLLM loads as well.

Real models bring their own `tokenizer.json`; the arithmetic task uses a character-level tokenizer built here
with the `tokenizers` library and saved in the same format.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
# Plain concatenation of the user turns: the tiny task model is trained on raw prompts, no role markers.
PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_char_tokenizer(chars: str) -> PreTrainedTokenizerFast:
    """One token per character of `chars`, plus pad / eos / unk specials (ids 0, 1, 2)."""
    if len(set(chars)) != len(chars):
        raise ValueError(f"duplicate characters in tokenizer alphabet {chars!r}")
    specials = [PAD, EOS, UNK]
    vocab = {tok: i for i, tok in enumerate(specials + list(chars))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK)
    hf.chat_template = PLAIN_CHAT_TEMPLATE
    return hf


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """An HF tokenizer folder, offline only (no hub look-ups)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json / tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, use_chat_template: bool) -> list[int]:
    """Token ids of a prompt, through the tokenizer's chat template (as a user turn) when asked."""
    if use_chat_template:
        if tokenizer.chat_template is None:
            raise ValueError("tokenizer.use_chat_template = true but the tokenizer has no chat template")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
