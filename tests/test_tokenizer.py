"""Tokenizers: tiny (in-process), GGUF-built, and chat templates against transformers."""

import pytest

from starpo.tokenizer import Tokenizer

VARIED = [
    "", "hello world", "  leading and trailing  ", "Turn 1:\nState:\n#####\n#_P_#\n#####",
    "<think>I should push the box up.</think><answer>Up || Left</answer>",
    "numbers 0 12 345 6789 -0.1 10.9 1e-3", "tabs\tand\r\nwindows lines", "émoji 🙂 naïve café",
    "中文字符 and ελληνικά", "<|im_start|>user\nhi<|im_end|>", "√X√ P_O_G", "don't can't I'll",
    "a" * 50, "    ", "\n\n\n",
]


def test_tiny_tokenizer_is_deterministic_and_round_trips(tiny_tokenizer):
    again = Tokenizer.tiny()
    assert again.hf.backend_tokenizer.to_str() == tiny_tokenizer.hf.backend_tokenizer.to_str()
    for text in VARIED:
        ids = tiny_tokenizer.encode(text)
        assert tiny_tokenizer.decode(ids) == text, text
    # merges were learned: common words are single tokens, specials stay whole
    assert len(tiny_tokenizer.encode("<think>")) < len("<think>")
    assert tiny_tokenizer.encode("<|im_end|>") == [tiny_tokenizer.eos_ids[0]]


def test_token_bytes_concatenate_to_the_text(tiny_tokenizer):
    table = tiny_tokenizer.token_bytes()
    assert len(table) == tiny_tokenizer.vocab_size
    for text in VARIED:
        assert b"".join(table[i] for i in tiny_tokenizer.encode(text)) == text.encode("utf-8")


def test_chatml_template_by_hand(tiny_tokenizer):
    msgs = [{"role": "system", "content": "You're a helpful assistant. "},
            {"role": "user", "content": "Turn 1:\nState:\nP_G"},
            {"role": "assistant", "content": "<think>x</think><answer>Right</answer>"},
            {"role": "user", "content": "Reward:\n1.0\n"}]
    want = ("<|im_start|>system\nYou're a helpful assistant. <|im_end|>\n"
            "<|im_start|>user\nTurn 1:\nState:\nP_G<|im_end|>\n"
            "<|im_start|>assistant\n<think>x</think><answer>Right</answer><|im_end|>\n"
            "<|im_start|>user\nReward:\n1.0\n<|im_end|>\n<|im_start|>assistant\n")
    assert tiny_tokenizer.apply_chat_template(msgs) == want


def test_chat_template_matches_transformers_autotokenizer(tmp_path, tiny_tokenizer):
    from transformers import AutoTokenizer

    tiny_tokenizer.save(str(tmp_path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_hf_dir(str(tmp_path))
    msgs = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"}]
    for gen in (True, False):
        assert ours.apply_chat_template(msgs, gen) == ref.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=gen)
    for text in VARIED:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)


def test_unsupported_gguf_tokenizer_is_named():
    with pytest.raises(ValueError, match="GGUF tokenizer model 'llama' is not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"})
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"],
            "tokenizer.ggml.merges": [], "tokenizer.ggml.pre": "mystery"}
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf_metadata(meta)
