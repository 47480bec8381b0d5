"""Character tokenizer: round trip, specials, HF folder that AutoTokenizer loads with its chat template."""

from pipelinerl_fsdp.tasks.arithmetic import ALPHABET
from pipelinerl_fsdp.tokenizer import EOS, build_char_tokenizer, encode_prompt, load_tokenizer


def test_char_tokenizer_roundtrip_and_folder(tmp_path):
    tok = build_char_tokenizer(ALPHABET)
    text = "12+345=\n357+1=358\nA:358"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.eos_token == EOS and tok.eos_token_id == 1 and tok.pad_token_id == 0
    assert len(tok) == len(ALPHABET) + 3
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert again.eos_token_id == tok.eos_token_id
    assert encode_prompt(again, "1+2=", use_chat_template=True) == encode_prompt(again, "1+2=", False)
    # unknown characters map to <|unk|> instead of failing
    assert again("x", add_special_tokens=False)["input_ids"] == [2]
