"""Tokenizers as HF folders (tokenizer.json + tokenizer_config.json, with chat template) that vLLM loads as well.

Real models bring their own `tokenizer.json`; the arithmetic tasks use a character-level tokenizer built here
with the `tokenizers` library and saved in the same format.

The character tokenizer is a byte-level BPE with one token per character and no merges. A plainer WordLevel
model would do in memory, but `AutoTokenizer` (and so vLLM) does not load it back as written: for some model
types (qwen2 among them) transformers ignores the folder's tokenizer class and rebuilds the tokenizer as that
family's byte-level BPE from the vocabulary, which silently dropped characters such as "\n". A byte-level BPE
vocabulary survives that rebuild unchanged, so every stage sees the same ids (tested on every task character).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pipelinerl_fsdp.config import TokenizerConfig

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
# Plain concatenation of the user turns: the tiny task model is trained on raw prompts, no role markers.
PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE (GPT-2's): printable bytes map to themselves."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def build_char_tokenizer(chars: str) -> PreTrainedTokenizerFast:
    """One token per character of `chars` (ids 3, 4, ... in order), plus pad / eos / unk specials (ids 0, 1, 2).
    Characters outside `chars` are not part of any task; they map to <|unk|> in memory (a reloaded folder may
    drop them instead)."""
    if len(set(chars)) != len(chars):
        raise ValueError(f"duplicate characters in tokenizer alphabet {chars!r}")
    specials = [PAD, EOS, UNK]
    byte_chars = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(specials)}
    for c in chars:
        vocab["".join(byte_chars[b] for b in c.encode())] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK)
    hf.chat_template = PLAIN_CHAT_TEMPLATE
    return hf


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """An HF tokenizer folder, offline only (no hub look-ups)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json / tokenizer_config.json (not a tokenizer folder)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers' parse errors (a corrupt tokenizer.json) do not name the folder
        raise ValueError(f"{path}: the tokenizer does not load ({type(e).__name__}: {e})") from e
    if tok.eos_token_id is None:
        raise ValueError(f"{path}: the tokenizer has no EOS token; completions could never end")
    return tok


def completion_text(tokenizer: PreTrainedTokenizerBase, tokens: list[int], stop_ids: list[int] | None = None) -> str:
    """Decoded completion up to (not including) the first stop token (default: the tokenizer's EOS)."""
    stops = set(stop_ids) if stop_ids else {tokenizer.eos_token_id}
    for i, t in enumerate(tokens):
        if t in stops:
            tokens = tokens[:i]
            break
    return tokenizer.decode(tokens, skip_special_tokens=True)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, fmt: TokenizerConfig) -> list[int]:
    """Token ids of a prompt: through the tokenizer's chat template (an optional system turn, then `text` as the
    user turn, then the generation prompt) when `fmt.use_chat_template`, else the plain text."""
    if not fmt.use_chat_template:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.chat_template is None:
        raise ValueError("tokenizer.use_chat_template = true but the tokenizer has no chat template")
    messages = ([{"role": "system", "content": fmt.system_prompt}] if fmt.system_prompt else []) + [
        {"role": "user", "content": text}
    ]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **fmt.chat_template_kwargs)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
