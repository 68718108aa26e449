"""What a refit loads into a generator's in-process vLLM engine
(pipeline/generator/vllm_engine.py): a full HF-named state dict in place,
through a refit plan once one is recorded, or a new version of the LoRA
adapter every request carries (training.lora). The engine imports vLLM
first, with its environment set."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from vllm.lora.request import LoRARequest

from pipeline.core.spans import span
from pipeline.generator.cpu_moe import repack_experts_on_reload
from pipeline.inputs.models import ModelError
from pipeline.weights import lora


class EngineWeights:
    """`loaded(names)`: the engine's, after each load: what the old weights computed goes."""

    # On CPU, linear layers of at most this many weights keep them plain after
    # the first load (refit_plan.RefitPlan._unpack): the largest in which F.linear
    # matched oneDNN at every batch size, timed on this 2-core machine.
    PLAIN_LINEAR_MAX = 1 << 16

    def __init__(self, llm: Any, model_path: str, vocab_size: int, adapter_config: dict | None,
                 loaded: Callable[[list[str]], None]):
        self.llm, self.model_path, self.vocab_size, self.loaded = llm, model_path, vocab_size, loaded
        self.plan: Any = None  # RefitPlan after the first load; False: this model needs reload_weights
        self.plan_off = ""
        if repack_experts_on_reload(self._model()[0]):
            # A copy into the experts' weights would leave them unpacked; reload_weights runs their repacking.
            self.plan, self.plan_off = False, "CPU MoE experts are repacked after each load"
        self.adapter_config = adapter_config
        self.adapter: LoRARequest | None = None  # every request's adapter, once one is loaded
        self.adapter_dir: Path | None = None
        if adapter_config is not None:
            shm = Path("/dev/shm")
            self.adapter_dir = Path(tempfile.mkdtemp(prefix="dagrl-lora-", dir=shm if shm.is_dir() else None))

    def load(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
        if lora.is_adapter(name for name, _ in items):
            self.load_adapter(dict(items))
            return
        self.load_stream([(name, t.dtype, tuple(t.shape)) for name, t in items], iter(items), stable=True)

    def load_stream(self, entries: Sequence[tuple[str, Any, tuple[int, ...]]],
                    stream: Iterable[tuple[str, torch.Tensor]], *, stable: bool = False) -> None:
        if lora.is_adapter(name for name, _, _ in entries):
            self.load_adapter({name: t if stable else t.clone() for name, t in stream})
            return
        self.check_entries(entries)
        # The span keeps reload_weights' name: the step profile and its test read it.
        names = [name for name, _, _ in entries]
        with span("vllm.reload_weights"):
            self._load(names, stream, stable)
        self.loaded(names)

    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Serve a new version of the adapter: vLLM reloads it in place under the
        same id, so requests in flight go on with it (as with a full load),
        and the base weights stay as they are."""
        if self.adapter_config is None:
            raise ModelError(f"load_weights into {self.model_path!r}: got LoRA adapter tensors, but this engine "
                             "was started without training.lora")
        staging = self.adapter_dir / "next"
        with span("vllm.add_lora"):
            lora.write_adapter(staging, tensors, self.adapter_config, weights_file=lora.ADAPTER_WEIGHTS_TORCH)
            served = self.adapter_dir / "adapter"
            shutil.rmtree(served, ignore_errors=True)
            staging.rename(served)
            # load_inplace on this call only: a request's own LoRARequest must not reload it every step.
            if not self.llm.llm_engine.add_lora(LoRARequest("policy", 1, str(served), load_inplace=True)):
                raise RuntimeError(f"vLLM engine for {self.model_path!r}: the adapter in {served} did not load")
            self.adapter = LoRARequest("policy", 1, str(served))
        self.loaded(list(tensors))

    def destinations(self, names: Sequence[str]) -> Any:
        """For a load of `names` about to start: a function (name, dtype, nbytes)
        -> the tensor that tensor goes to whole, or None (refit_plan.RefitPlan.destination);
        None when the load will not replay a plan."""
        plan = self.plan
        return plan.destination if plan and plan.usable(list(names)) else None

    def check_entries(self, entries: Sequence[tuple[str, Any, tuple[int, ...]]]) -> None:
        """Refuse, before anything is loaded, a state dict whose vocabulary is padded."""
        for name, _, shape in entries:
            if ("embed_tokens" in name or name.startswith("lm_head")) and shape[0] != self.vocab_size:
                raise ModelError(f"load_weights into {self.model_path!r}: {name} has {shape[0]} rows "
                                 f"but the model's (unpadded) vocab_size is {self.vocab_size}")

    def close(self) -> None:
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)

    def _load(self, names: list[str], stream: Iterable[tuple[str, torch.Tensor]], stable: bool) -> None:
        """A load records where each name lands (refit_plan.RefitPlan, through the
        model's own weight loaders) and the next ones with the same names copy
        straight there. Where no plan can be made (a quantized model, an engine
        in another process, a loader that computes) vLLM's reload_weights does
        it: it re-runs every loader and repacks every layer, 20 ms on the tiny
        model of which 0.1 is copying bytes."""
        from vllm.config import set_current_vllm_config
        from vllm.platforms import current_platform

        from pipeline.generator.refit_plan import RefitPlan
        model, config = self._model()
        if model is not None and self.plan is not False:
            with set_current_vllm_config(config), torch.no_grad():
                if self.plan is not None and self.plan.usable(names):
                    # vLLM's Zen CPU path keeps the unpacked weight itself (when it does not
                    # prepack): a borrowed buffer would be read after the load.
                    self.plan.load(stream, borrow=stable and not current_platform.is_zen_cpu())
                    return
                self.plan, why = RefitPlan.record(model, names, stream, plain_max=self.PLAIN_LINEAR_MAX)
                if why:
                    self.plan_off = why  # this load went through the model's loaders; later ones reload
                    self.plan = False
                return
        items = list(stream) if stable else [(name, t.clone()) for name, t in stream]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})

    def _model(self) -> tuple[Any, Any]:
        """The engine's torch model and config when it runs in this process
        (the in-process engine this module asks for), else (None, None)."""
        engine = self.llm.llm_engine
        worker = getattr(getattr(engine, "model_executor", None), "driver_worker", None)
        if worker is None or engine.vllm_config.quant_config is not None:
            return None, None  # quantized layers repack differently: reload_weights knows how
        return worker.model_runner.model, engine.vllm_config
