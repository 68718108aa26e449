"""load_tokenizer reads a saved tokenizer's class from its files instead of
asking AutoTokenizer (which imports torch): it must load what AutoTokenizer
loads, for every prompt the run renders and counts."""
from __future__ import annotations

import json
import shutil

import pytest

from pipeline.inputs.datasets import ChatTemplate
from pipeline.inputs.models import load_tokenizer
from pipeline.inputs.tiny import build_tiny_model

pytestmark = pytest.mark.unit

TEXTS = ["repeat: 1 2 3", "  Tom has 12 apples.\nHow many?  ", "émoji 🙂 and <s> inside", ""]
CHAT = [{"role": "user", "content": "What is 7 + 5?"}]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_chat", chat_template="plain")


def _same(ours, theirs):
    assert type(ours) is type(theirs) and len(ours) == len(theirs)
    assert ours.special_tokens_map == theirs.special_tokens_map
    for text in TEXTS:
        assert ours(text).input_ids == theirs(text).input_ids, text
    system = "Answer with a number."
    assert ChatTemplate(ours, system).render(CHAT) == ChatTemplate(theirs, system).render(CHAT)


def test_a_saved_tokenizer_loads_as_autotokenizer_loads_it(chat_model):
    from transformers import AutoTokenizer
    _same(load_tokenizer(chat_model), AutoTokenizer.from_pretrained(str(chat_model)))


def test_a_tokenizer_config_that_names_no_backend_goes_through_autotokenizer(chat_model, tmp_path):
    from transformers import AutoTokenizer
    model = tmp_path / "model"
    shutil.copytree(chat_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "backend"}))
    _same(load_tokenizer(model), AutoTokenizer.from_pretrained(str(model)))
