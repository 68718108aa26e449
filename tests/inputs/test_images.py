"""Pictures in a prompt dataset (pipeline/inputs/images.py), no model: verl's
multimodal Parquet (image bytes or paths, `<image>` in the text) and TRL's
layout (image parts), rendered by the tiny VLM's chat template with one
placeholder per picture; each bad row an error naming the file and the row."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.inputs.datasets import ChatTemplate, DataError, load_prompts
from pipeline.inputs.tiny import build_tokenizer
from pipeline.inputs.tiny_vlm import QUESTION, TINY_VLM_CHAT_TEMPLATE, VISION_TOKENS, digit_png, digit_rows

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def chat():
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.chat_template = TINY_VLM_CHAT_TEMPLATE
    return ChatTemplate(tok)


def image_pads(chat, prompt) -> int:
    return prompt.token_ids.count(chat.tokenizer.convert_tokens_to_ids("<|image_pad|>"))


@pytest.mark.parametrize("as_object", [False, True], ids=["bytes", "hf_image_objects"])
def test_verl_multimodal_parquet(tmp_path, chat, as_object):
    rows = digit_rows(2)
    pictures = [r["images"][0] for r in rows]
    if as_object:   # HF datasets' Image feature
        for r in rows:
            r["images"] = [{"bytes": r["images"][0], "path": None}]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    prompts = load_prompts(path, chat=chat)
    assert [p.images for p in prompts] == [(b,) for b in pictures]
    assert all(image_pads(chat, p) == 1 for p in prompts)
    assert "<|vision_start|><|image_pad|><|vision_end|>Which digit" in prompts[0].text
    assert [p.answer for p in prompts] == [r["answer"] for r in rows]


def test_trl_layout_with_image_parts_and_paths_relative_to_the_file(tmp_path, chat):
    (tmp_path / "pics").mkdir()
    for d in "01":
        (tmp_path / "pics" / f"{d}.png").write_bytes(digit_png(d))
    row = {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which?"},
                                                   {"type": "image"}]}],
           "images": ["pics/0.png", str(tmp_path / "pics" / "1.png")], "answer": "0"}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (prompt,) = load_prompts(path, chat=chat)
    assert prompt.images == (digit_png("0"), digit_png("1")) and image_pads(chat, prompt) == 2


@pytest.mark.parametrize("row, message", [
    ({"images": ["missing.png"]}, "line 1: field 'images[0]': cannot read the image file"),
    ({"images": [b"not a png".hex()]}, "cannot read the image file"),
    ({"images": ["bad.png"]}, "line 1: field 'images[0]': not an image that can be read"),
    ({"images": [7]}, "an image is its file's bytes, a path"),
    ({"images": ["ok.png", "ok.png"]}, "marks 1 image(s)"),
    ({"prompt": "text <image>", "images": ["ok.png"]}, "a row with images needs its prompt as chat messages"),
])
def test_a_bad_image_row_names_the_file_and_the_row(tmp_path, chat, row, message):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    (tmp_path / "ok.png").write_bytes(digit_png("1"))
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": QUESTION}], "answer": "1", **row}) + "\n")
    with pytest.raises(DataError) as err:
        load_prompts(path, chat=chat)
    assert str(path) in str(err.value) and message in str(err.value)


def test_an_unreadable_image_in_parquet_names_its_row(tmp_path, chat):
    rows = digit_rows(3)
    rows[2]["images"] = [b"\x89PNG broken"]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"d\.parquet: row 2: column 'images\[0\]': not an image"):
        load_prompts(path, chat=chat)


def test_a_dataset_without_pictures_reads_as_before(tmp_path, chat):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi <image>"}], "answer": "1"}) + "\n")
    (prompt,) = load_prompts(path, chat=chat)
    assert prompt.images == () and "hi <image>" in prompt.text


def test_a_prompt_with_pictures_goes_through_a_checkpoints_json():
    from pipeline.core.types import Prompt
    prompt = Prompt("p", "t", "1", token_ids=(1, 2), images=(digit_png("1"), digit_png("2")))
    assert Prompt.from_state(json.loads(json.dumps(prompt.state()))) == prompt


def test_a_pictures_tokens_count_against_the_context(tmp_path, chat):
    from pipeline.inputs.datasets import fit_prompts
    from pipeline.inputs.images import ImageTokens
    from pipeline.inputs.tiny_vlm import SIDE
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    Qwen2VLImageProcessorPil(min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE).save_pretrained(tmp_path)
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(digit_rows(1)), path)
    (prompt,) = load_prompts(path, chat=chat)
    sent = len(prompt.token_ids) + 3    # the one placeholder becomes the picture's 4 tokens
    tokens = ImageTokens(tmp_path)
    assert tokens(prompt.images[0]) == 4
    assert len(fit_prompts(path, "train", chat.tokenizer, context=sent + 8, max_new_tokens=8, drop=False,
                           image_tokens=tokens).prompts) == 1
    with pytest.raises(DataError, match=f"the prompt is {sent} tokens"):
        fit_prompts(path, "train", chat.tokenizer, context=sent + 7, max_new_tokens=8, drop=False, image_tokens=tokens)
    with pytest.raises(DataError, match="has no image processor"):
        fit_prompts(path, "train", chat.tokenizer, context=sent + 8, max_new_tokens=8, drop=False)


def fake_vlm_config(model_dir, *settings: str):
    """A recipe on a directory that passes the quick model checks as a VLM; its data is never read."""
    import numpy as np
    from safetensors.numpy import save_file

    from pipeline.config import load_config
    (model_dir / "config.json").write_text(json.dumps({"vision_config": {}, "text_config": {"vocab_size": 8}}))
    save_file({"w": np.zeros(1, np.float32)}, str(model_dir / "model.safetensors"))
    (model_dir / "tokenizer.json").write_text("{}")
    return load_config(None, ["backend=real", f"model.path={model_dir}", "data.train=unread.jsonl",
                              "data.reward=unread:reward", *(s.format(model=model_dir) for s in settings)])


@pytest.mark.parametrize("setting, key", [("algorithm=ppo", "algorithm ppo"), ("distill.teacher={model}", "distill.teacher"),
                                          ("agent.function=tests.agents.agents_for_tests:plain_def", "agent.function")])
def test_a_vlm_with_a_setting_it_does_not_run_with_is_refused_before_any_worker(tmp_path, setting, key):
    from pipeline.inputs.models import ModelError
    from pipeline.inputs.preflight import preflight
    cfg = fake_vlm_config(tmp_path, setting)
    with pytest.raises(ModelError, match=f"model.path: .* is a vision-language model, which trains without {key}"):
        preflight(cfg)


def test_a_vlm_with_lora_passes_the_model_checks(tmp_path):
    """A LoRA on a VLM adapts its language model (pipeline/weights/lora.py): preflight
    goes on past the model directory to the data, which this recipe lacks."""
    from pipeline.inputs.preflight import preflight
    with pytest.raises(DataError, match="data.train"):
        preflight(fake_vlm_config(tmp_path, "training.lora.rank=4"))
