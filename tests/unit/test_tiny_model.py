"""The embedded `seedance-tiny` model: it loads with plain transformers, has the special tokens and
the ChatML template the server relies on, fits the size budget, and writes Python-shaped code.

The Python-shape checks are chosen so that a random-weight model of the same config fails them
(it repeats one token forever); see `python_shape_problems`.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TINY_DIR = Path(__file__).resolve().parents[2] / "seedance" / "assets" / "seedance-tiny"
SIZE_BUDGET_BYTES = 12 * 1024 * 1024
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_DIR)


@pytest.fixture(scope="module")
def model():
    loaded = AutoModelForCausalLM.from_pretrained(TINY_DIR, dtype=torch.float32)
    loaded.eval()
    return loaded


def greedy(model, tokenizer, prompt: str, new_tokens: int = NEW_TOKENS) -> str:
    """`prompt` plus its greedy continuation; the tokenizer prepends `<s>`, as every training
    file began."""
    ids = tokenizer.encode(prompt)
    assert ids[0] == tokenizer.bos_token_id
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return prompt + tokenizer.decode(out[0, len(ids) :])


def python_shape_problems(text: str) -> list[str]:
    """What keeps `text` (a prompt plus its greedy continuation) from looking like Python.

    The first line must parse as a Python statement (a `def` header gets a `pass` body to make it
    complete), the model must have ended that line itself, and a `def` must be followed by an
    indented body.
    """
    first, newline, rest = text.partition("\n")
    problems = []
    if not newline:
        problems.append("the model never ended the first line")
    statement = first + ("\n    pass" if first.rstrip().endswith(":") else "")
    try:
        ast.parse(statement)
    except SyntaxError as exc:
        problems.append(f"first line is not a Python statement: {first!r} ({exc.msg})")
    if first.startswith("def ") and not (rest[:1] in (" ", "\t") and rest.strip()):
        problems.append(f"no indented body after the def header: {rest[:40]!r}")
    return problems


def test_directory_fits_the_size_budget():
    size = sum(f.stat().st_size for f in TINY_DIR.iterdir() if f.is_file())
    assert size <= SIZE_BUDGET_BYTES, f"{size:,} bytes > {SIZE_BUDGET_BYTES:,}"


def test_directory_holds_hugging_face_files_and_training_log():
    names = {f.name for f in TINY_DIR.iterdir()}
    expected = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "TRAINING_LOG.md",
    }
    assert expected <= names
    assert "FINAL LOSS" in (TINY_DIR / "TRAINING_LOG.md").read_text(encoding="utf-8")


def test_config_is_a_grouped_query_llama_with_head_dim_64(model):
    config = model.config
    assert config.model_type == "llama"
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.head_dim == 64
    assert config.max_position_embeddings >= 1024
    assert json.loads((TINY_DIR / "config.json").read_text())["dtype"] == "bfloat16"


def test_special_tokens_are_single_ids(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<s>",
        "</s>",
        "<pad>",
    )
    ids = {}
    for token in ("<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"):
        encoded = tokenizer.encode(token, add_special_tokens=False)
        assert len(encoded) == 1, (token, encoded)
        assert tokenizer.convert_ids_to_tokens(encoded[0]) == token
        ids[token] = encoded[0]
    assert len(set(ids.values())) == 5


def test_generation_stops_on_end_of_text_and_end_of_turn(tokenizer, model):
    eos = model.generation_config.eos_token_id
    assert sorted(eos) == sorted(tokenizer.convert_tokens_to_ids(["</s>", "<|im_end|>"]))


def test_chat_template_renders_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Sort a list."},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSort a list.<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == rendered + "<|im_start|>assistant\n"


def test_tokenizer_round_trips_python_source(tokenizer):
    source = "def area(self, r):\n    return 3.14159 * r ** 2  # é\n"
    assert tokenizer.decode(tokenizer.encode(source, add_special_tokens=False)) == source


@pytest.mark.parametrize("prompt", ["def ", "import "])
def test_greedy_output_is_python_shaped(tokenizer, model, prompt):
    text = greedy(model, tokenizer, prompt)
    assert python_shape_problems(text) == [], text
