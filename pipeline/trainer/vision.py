"""A vision-language policy in the trainer: its model class, its frozen vision
tower, and the pixels of a micro-batch's pictures.

The pictures travel with a trajectory as their files' bytes (the `images`
column); the trainer turns them into pixels with the model directory's own
image processor, as vLLM's processor does for the engine, so both see the same
pixels, and the placeholder tokens come with the prompt ids vLLM returned. A
picture is processed once per process while it is in the cache: a group's
samples, and a step's passes over them, share it.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path

import torch

from pipeline.inputs.images import VISION_PREFIXES, decode, placeholder_token_ids
from pipeline.inputs.models import model_config, policy_model_class

CACHED_IMAGES = 1024
# What a checkpoint carries besides the weights and the tokenizer: the image processor's config.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def load_policy_model(model_path: str | Path) -> torch.nn.Module:
    """The HF model of `model_path` in fp32, of policy_model_class."""
    return policy_model_class(model_path).from_pretrained(model_path, dtype=torch.float32)


def freeze_vision(model: torch.nn.Module) -> frozenset[str]:
    """Freeze the vision tower and projector (model.freeze_vision); the names frozen."""
    frozen = frozenset(name for name, _ in model.named_parameters() if name.startswith(VISION_PREFIXES))
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return frozen


class Pixels:
    """A micro-batch's pictures as the model takes them beside its token ids:
    `pixel_values`, `image_grid_thw`, and `mm_token_type_ids` (1 on each picture's
    placeholder tokens, from which the model computes its multimodal positions)."""

    def __init__(self, model_path: str | Path):
        from transformers import AutoImageProcessor
        self.processor = AutoImageProcessor.from_pretrained(str(model_path))
        config = model_config(model_path)
        self.image_token_id = int(config["image_token_id"])
        self.placeholders = placeholder_token_ids(config)
        self._cache: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def inputs(self, images: list[list[bytes]], ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """For the rows of `ids` ([rows, length]), their pictures in row order, each
        row's in its placeholders' order; {} for none."""
        processed = [self._one(image) for row in images for image in row]
        if not processed:
            return {}
        return {"pixel_values": torch.cat([p for p, _ in processed]).to(ids.device),
                "image_grid_thw": torch.cat([g for _, g in processed]).to(ids.device),
                "mm_token_type_ids": (ids == self.image_token_id).int()}

    def _one(self, image: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        key = hashlib.blake2b(image, digest_size=16).digest()
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        out = self.processor(images=[decode(image)], return_tensors="pt")
        self._cache[key] = (out["pixel_values"].float(), out["image_grid_thw"])
        if len(self._cache) > CACHED_IMAGES:
            self._cache.popitem(last=False)
        return self._cache[key]
