"""Character tokenizer: round trip, specials, and a saved folder that loads back as the same tokenizer through
AutoTokenizer next to a model config of every family (transformers picks the tokenizer class by model type)."""

import json

import pytest

from pipelinerl_fsdp.config import TokenizerConfig
from pipelinerl_fsdp.models import build_model, flavour_args, save_hf_folder
from pipelinerl_fsdp.tasks import TASKS
from pipelinerl_fsdp.tokenizer import EOS, build_char_tokenizer, completion_text, encode_prompt, load_tokenizer


def test_char_tokenizer_roundtrip_in_memory():
    alphabet = TASKS["chain_sum"].alphabet
    tok = build_char_tokenizer(alphabet)
    text = "12+345=\n357+1=358\nA:358"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.eos_token == EOS and tok.eos_token_id == 1 and tok.pad_token_id == 0
    assert len(tok) == len(alphabet) + 3
    assert [tok.convert_tokens_to_ids(t) for t in ("<|pad|>", "<|endoftext|>", "<|unk|>")] == [0, 1, 2]
    assert tok("x", add_special_tokens=False)["input_ids"] == [2]  # outside the alphabet: <|unk|> in memory


@pytest.mark.parametrize("flavour", ["debug", "debug-llama", "debug-qwen3"])
def test_saved_folder_loads_back_as_the_same_tokenizer(tmp_path, flavour):
    alphabet = "".join(sorted({c for cls in TASKS.values() for c in cls.alphabet}))
    tok = build_char_tokenizer(alphabet)
    args = flavour_args(flavour, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    save_hf_folder(tmp_path, args, build_model(args).state_dict())
    tok.save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == args.model_type
    again = load_tokenizer(tmp_path)
    for c in alphabet:  # every character of every task, alone and between others
        for text in (c, f"1{c}2", c * 3):
            assert (
                again(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
            ), (type(again).__name__, repr(text))
            assert again.decode(again(text, add_special_tokens=False)["input_ids"]) == text
    assert again.eos_token_id == tok.eos_token_id and again.pad_token_id == tok.pad_token_id
    assert again(EOS + "1", add_special_tokens=False)["input_ids"] == [1, tok.convert_tokens_to_ids("1")]
    assert encode_prompt(again, "1+2=", TokenizerConfig(use_chat_template=True)) == encode_prompt(
        again, "1+2=", TokenizerConfig()
    )


def test_completion_text_stops_at_the_first_stop_token():
    tok = build_char_tokenizer("0123456789")
    ids = tok("12", add_special_tokens=False)["input_ids"]
    seven = tok.convert_tokens_to_ids("7")
    assert completion_text(tok, ids + [1] + ids) == "12"
    assert completion_text(tok, ids + [seven] + ids, stop_ids=[1, seven]) == "12"
    assert completion_text(tok, ids) == "12"
