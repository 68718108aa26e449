"""A tiny vision-language model and a picture task, built offline.

The model: a random Qwen2-VL (its vision tower, its projector and a 2-layer
language model), the tiny tokenizer with Qwen2-VL's vision tokens added, a chat
template that writes each image part as Qwen2-VL's templates do
(<|vision_start|><|image_pad|><|vision_end|>), and the image processor's
config, all saved with `save_pretrained` so that transformers and vLLM load the
directory like a hub checkpoint.

The task ("digits"): a picture of one digit, drawn as a seven-segment display,
and the question which digit it is; the reward is tiny_reward's, the fraction
of the answer's characters that are the digit (pipeline/rewards/rules.py), so
a policy that answers one digit whatever the picture scores 1 / len(DIGITS).
The rows are verl's multimodal layout: `images` (a list of PNG bytes) and
`<image>` in the message where the picture goes.
"""
from __future__ import annotations

import io
import random
from pathlib import Path

from pipeline.inputs.tiny import CHAT_TEMPLATES, build_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# TINY_CHAT_TEMPLATE with content parts: an image part as Qwen2-VL's templates write it.
TINY_VLM_CHAT_TEMPLATE = CHAT_TEMPLATES["plain"].replace(
    "{{ m['content'] }}",
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}")

WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 40, 32, 5e-3
SIDE = 56           # every picture is resized to SIDE x SIDE: 4 x 4 patches of 14, merged 2 x 2 into 4 tokens
DIGITS = "0123"
QUESTION = "<image>Which digit is shown?"
# The segments lit for each digit: a b c d e f g (top, top right, bottom right, bottom,
# bottom left, top left, middle), as a seven-segment display draws them.
SEGMENTS = {"0": "abcdef", "1": "bc", "2": "abdeg", "3": "abcdg", "4": "bcfg", "5": "acdfg", "6": "acdefg",
            "7": "abc", "8": "abcdefg", "9": "abcdfg"}


def digit_png(digit: str, *, ink: tuple[int, int, int] = (255, 255, 255), side: int = SIDE) -> bytes:
    """A seven-segment `digit` in `ink` on black, as PNG bytes."""
    from PIL import Image, ImageDraw
    image = Image.new("RGB", (side, side), (0, 0, 0))
    draw = ImageDraw.Draw(image)
    x0, x1, w = side // 4, side - side // 4, max(side // 10, 2)
    y0, y1, y2 = side // 8, side // 2, side - side // 8
    boxes = {"a": (x0, y0, x1, y0 + w), "b": (x1 - w, y0, x1, y1), "c": (x1 - w, y1, x1, y2),
             "d": (x0, y2 - w, x1, y2), "e": (x0, y1, x0 + w, y2), "f": (x0, y0, x0 + w, y1),
             "g": (x0, y1 - w // 2, x1, y1 + w // 2)}
    for segment in SEGMENTS[digit]:
        draw.rectangle(boxes[segment], fill=ink)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def digit_rows(n: int, *, seed: int = 0, digits: str = DIGITS) -> list[dict]:
    """`n` rows of the digits task in verl's layout; every digit equally often, each
    drawn in a bright ink of its own, so that validation shows pictures training did not.

    Not moved about: in 4 x 4 patches a shift of 2 pixels moved the frozen random
    vision tower's encoding further than a change of digit does (between-digit over
    within-digit variance of the pooled encodings 0.59; 3.95 unmoved), and GRPO
    settled on one digit for every picture in 150 steps whatever the lr and group."""
    rng = random.Random(seed)
    chosen = [digits[i % len(digits)] for i in range(n)]
    rng.shuffle(chosen)
    rows = []
    for i, d in enumerate(chosen):
        ink = tuple(rng.randint(128, 255) for _ in range(3))
        rows.append({"id": f"digit-{seed}-{i}", "prompt": [{"role": "user", "content": QUESTION}],
                     "images": [digit_png(d, ink=ink)], "answer": d, "data_source": "tiny_digits"})
    return rows


def write_digit_data(out_dir: str | Path, *, n_train: int = 512, n_val: int = 64) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n, seed in (("tiny_vlm_train.parquet", n_train, 0), ("tiny_vlm_val.parquet", n_val, 1)):
        path = out / name
        pq.write_table(pa.Table.from_pylist(digit_rows(n, seed=seed)), path)
        paths.append(path)
    return paths


def build_tiny_vlm(out_dir: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 2,
                   intermediate: int = 128, vision_dim: int = 64, vision_depth: int = 2,
                   max_positions: int = 512, init_std: float = 0.02, warmup_steps: int = WARMUP_STEPS) -> Path:
    """Build and save a random tiny Qwen2-VL, its tokenizer and image processor into `out_dir`.

    The language model's head size is hidden / heads (32: a size vLLM's CPU
    attention has), its rotary dimensions split over time, height and width as
    Qwen2-VL's multimodal rotary embedding splits them (mrope_section, half the
    head size). Weights are fp32, so vLLM and transformers compute the same logprobs.
    `warmup_steps`: of warm_up_format, the answer's form (0: the random model)."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(384)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = TINY_VLM_CHAT_TEMPLATE
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    half = hidden // heads // 2
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                max_position_embeddings=max_positions, rms_norm_eps=1e-6, initializer_range=init_std,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=vision_depth, embed_dim=vision_dim, hidden_size=hidden, num_heads=2, mlp_ratio=2,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, initializer_range=init_std)
    config = transformers.Qwen2VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False, dtype="float32",
        architectures=["Qwen2VLForConditionalGeneration"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2VLForConditionalGeneration(config).to(torch.float32)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    # The PIL image processor: transformers' default one needs torchvision, which vLLM's CPU build cannot have.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    processor = Qwen2VLImageProcessorPil(min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE, patch_size=14,
                                         merge_size=2, temporal_patch_size=2)
    if warmup_steps:
        warm_up_format(model, tokenizer, processor, steps=warmup_steps, seed=seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def warm_up_format(model, tokenizer, processor, *, steps: int, seed: int) -> None:
    """Teach the answer's form, not the answer: for pictures of the task, a digit
    drawn at random whatever the picture, then the end of text. The model then
    answers one digit and stops, each about as often whatever it is shown
    (greedy validation stays at a constant answer's 0.25), and GRPO's groups
    hold right and wrong digits from the first step.

    Without it, the random model's answers held a digit by chance, and whichever
    was rewarded first spread to every picture: greedy validation settled at
    0.25 in 150 steps on every setting tried (lr 0.002-0.01, groups of 4 and 8,
    the vision tower frozen or trained), though the same model learns to read the
    digit supervised in 50 steps (the frozen tower's encodings tell the digits apart)."""
    import torch
    from pipeline.inputs.images import decode
    rng = random.Random(seed + 1)
    rows = digit_rows(256, seed=seed + 2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                          "text": QUESTION.replace("<image>", "")}]}], tokenize=False,
                                         add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    pictures = processor(images=[decode(r["images"][0]) for r in rows], return_tensors="pt")
    per_picture = len(pictures["pixel_values"]) // len(rows)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    at = prompt.index(pad)
    prompt = prompt[:at] + [pad] * (per_picture // processor.merge_size ** 2) + prompt[at + 1:]
    digits = [tokenizer.convert_tokens_to_ids(d) for d in DIGITS]
    optimizer = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("model.visual.")],
                                 lr=WARMUP_LR)
    model.train()
    for _ in range(steps):
        batch = rng.sample(range(len(rows)), WARMUP_BATCH)
        answers = [rng.choice(digits) for _ in batch]
        ids = torch.tensor([prompt + [a, tokenizer.eos_token_id] for a in answers])
        pixels = torch.cat([pictures["pixel_values"][i * per_picture:(i + 1) * per_picture] for i in batch])
        logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=pictures["image_grid_thw"][batch],
                       mm_token_type_ids=(ids == pad).int()).logits
        loss = torch.nn.functional.cross_entropy(logits[:, -3:-1].reshape(-1, logits.shape[-1]),
                                                 ids[:, -2:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
