"""Images in a prompt dataset: the row's pictures as bytes, and its messages with image parts.

Two layouts, as the peers write them:
- verl's: an `images` column (a list of image bytes, of paths, or of HF
  datasets' {"bytes", "path"} objects) and `<image>` in the messages' text
  where each picture goes, in order;
- TRL's: `images` (or one `image`) beside messages whose content is a list of
  parts, {"type": "image"} where each picture goes and {"type": "text",
  "text": ...} for the words.
Either becomes messages whose content is a list of parts, which the model's
chat template renders with its own image placeholder. The bytes are kept as the
file has them (a PNG of the tiny task is 200 bytes; its pixels as the model
takes them are 40 kB), and decoded where a model takes them: vLLM, and the
trainer through the model's image processor (pipeline/trainer/vision.py).
"""
from __future__ import annotations

import io
from pathlib import Path

from pipeline.inputs.rows import ROLES, Rows

IMAGE_COLUMNS = ("images", "image")
PLACEHOLDER = "<image>"   # verl's mark of where a picture goes in a message's text
# The parameters of a Qwen2-VL-style model's vision tower and its projector (the merger
# inside it), in transformers' names: what model.freeze_vision freezes.
VISION_PREFIXES = ("model.visual.", "visual.")


def placeholder_token_ids(config: dict) -> tuple[int, ...]:
    """The tokens that stand for a picture's (or a video's) encodings in a VLM's
    prompt, from its config.json; () for a text model. No response may hold
    one: the trainer's model puts a picture's encoding wherever it finds one,
    so neither the engine samples them nor the trainer scores them."""
    return tuple(int(config[key]) for key in ("image_token_id", "video_token_id") if key in config)


def image_column(data: Rows) -> str:
    """The column of a row's pictures, or "" for a dataset without."""
    return next((name for name in IMAGE_COLUMNS if name in data.names), "")


def row_images(data: Rows, i: int, name: str) -> tuple[bytes, ...]:
    """The row's pictures as their files' bytes, each checked to decode."""
    value = data.rows[i].get(name)
    if value is None:
        return ()
    listed = value if isinstance(value, list) else [value]
    return tuple(_image_bytes(data, i, f"{name}[{k}]" if isinstance(value, list) else name, v)
                 for k, v in enumerate(listed))


def _image_bytes(data: Rows, i: int, where: str, value) -> bytes:
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, str):
        path = Path(value) if Path(value).is_absolute() else data.path.parent / value
        try:
            value = path.read_bytes()
        except OSError as exc:
            raise data.error(i, f"{data.noun} {where!r}: cannot read the image file {str(path)!r}: "
                                f"{exc.strerror or exc}") from None
    if not isinstance(value, bytes):
        raise data.error(i, f"{data.noun} {where!r}: an image is its file's bytes, a path (relative to the "
                            f"data file) or an object with 'bytes' or 'path'; got {value!r:.80}")
    try:
        decode(value)
    except (OSError, ValueError) as exc:
        raise data.error(i, f"{data.noun} {where!r}: not an image that can be read ({exc})") from None
    return value


def decode(data: bytes):
    """A picture's bytes as an RGB PIL image, as both models take it."""
    from PIL import Image
    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


class ImageTokens:
    """How many placeholder tokens a picture takes in a model's prompt (its image
    processor's count of patches, merged), read from the picture's size alone: a
    prompt's length as the engine sees it, for data.filter_overlong."""

    def __init__(self, model_path: str | Path):
        from transformers import AutoImageProcessor
        self.processor = AutoImageProcessor.from_pretrained(str(model_path))

    def __call__(self, image: bytes) -> int:
        from PIL import Image
        with Image.open(io.BytesIO(image)) as opened:
            width, height = opened.size
        return self.processor.get_number_of_image_patches(height, width, {}) // self.processor.merge_size ** 2


def image_messages(data: Rows, i: int, name: str, count: int) -> list[dict]:
    """The row's chat messages with their pictures as parts: verl's `<image>` in
    the text, or TRL's parts as they are; as many image parts as `count`."""
    listed = data.rows[i][name]
    if not listed:
        raise data.error(i, f"{data.noun} {name!r} is an empty list of messages")
    out = [_message(data, i, name, k, m) for k, m in enumerate(listed)]
    parts = sum(part["type"] == "image" for m in out for part in m["content"])
    if parts != count:
        raise data.error(i, f"{data.noun} {name!r} marks {parts} image(s) ({PLACEHOLDER!r} in the text, or "
                            f"{{\"type\": \"image\"}} parts) but the row has {count}; each picture needs one mark")
    if out[-1]["role"] == "assistant":
        raise data.error(i, f"{data.noun} {name!r}: the last message is the assistant's; the model would "
                            "continue its turn instead of answering")
    return out


def _message(data: Rows, i: int, name: str, k: int, m) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise data.error(i, f"{data.noun} {name!r}: message {k} must be an object with a string 'role', "
                            f"got {m!r:.80}")
    if m["role"] not in ROLES:
        raise data.error(i, f"{data.noun} {name!r}: message {k} has role {m['role']!r}; "
                            f"expected one of {', '.join(ROLES)}")
    content = m.get("content")
    if isinstance(content, str):
        return {"role": m["role"], "content": _split(content)}
    if isinstance(content, list) and all(_is_part(p) for p in content):
        return {"role": m["role"], "content": [{"type": "image"} if p["type"] == "image" else
                                               {"type": "text", "text": p["text"]} for p in content]}
    raise data.error(i, f"{data.noun} {name!r}: message {k}'s content must be text or a list of "
                        f"{{\"type\": \"image\"}} and {{\"type\": \"text\", \"text\": ...}} parts, got {content!r:.80}")


def _is_part(p) -> bool:
    return isinstance(p, dict) and (p.get("type") == "image" or
                                    (p.get("type") == "text" and isinstance(p.get("text"), str)))


def _split(text: str) -> list[dict]:
    """verl's text with `<image>` marks as parts, in order."""
    pieces = text.split(PLACEHOLDER)
    parts: list[dict] = []
    for n, piece in enumerate(pieces):
        if n:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts
