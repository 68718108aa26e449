"""Where a state dict lands in a running vLLM model: the plan a generator
records once and every refit replays (RefitPlan)."""
from __future__ import annotations

import time
from typing import Any


class RefitPlan:
    """Where each tensor of a full HF-named state dict lands in a running vLLM
    model, recorded once from the model's own `load_weights` (fused qkv and
    gate_up slices, vocabulary padding, tied embeddings included), so that a
    refit is one copy per tensor instead of vLLM's reload_weights, which moves
    every layer to the meta device and back, re-runs each weight loader and
    repacks every layer (20 ms of the tiny model's load, against 0.1 ms of bytes).

    On CPU vLLM packs each linear layer's weight into a oneDNN handle and frees
    the plain tensor, so those slices are copied into a staging tensor instead
    and the layer is repacked by vLLM's own `process_weights_after_loading` as
    soon as its last slice has arrived; the staging tensors are reused, so a
    load holds a layer or two of them, not a second model. On GPU nothing is
    packed and a load is the copies alone, into the same storage (CUDA graphs
    keep pointing at it).
    """

    def __init__(self, targets: list, owners: list, layers: list, entries: dict) -> None:
        self.targets = targets    # per target: [layer, name, live tensor or None (staged), staging template]
        self.owners = owners      # per target: the indices of the layers holding it (two when tied)
        self.layers = layers      # per layer: (module, target indices, repack after the load?)
        self.entries = entries    # name -> [(target, storage offset, size, stride, fill value or None)]
        counts = [0] * len(targets)
        for writes in entries.values():
            for write in writes:
                counts[write[0]] += 1
        self.target_writes = counts
        self.filled = {w[0] for writes in entries.values() for w in writes if w[4] is not None}
        self.counts = [sum(counts[t] for t in tis) for _, tis, _ in layers]
        self.pool: dict = {}
        self.staged: dict | None = None   # during a load: target -> its staging tensor
        self.borrowed: set = set()        # during a load: the targets staged in the stream's own tensor
        self.uncopied = 0                 # of the last load: how many targets were repacked from the stream
        self.repack_s = 0.0       # of the last load: the share spent in vLLM's repacking (benchmarks/refit.py)

    @classmethod
    def record(cls, model: Any, names: list[str], stream: Any,
               plain_max: int = 0) -> tuple[RefitPlan | None, str]:
        """Load `stream` through `model.load_weights`, recording every write into a
        parameter; returns the plan, or None and why not (the load itself is done
        either way, by the model's own loaders). Packed layers of at most
        `plain_max` weights are unpacked for good (see `_unpack`)."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor, to_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
        targets, owners, layers, storage = [], [], [], {}
        for module in model.modules():
            info = LAYERWISE_INFO.get(module)
            metas = info.restore_metadata[0] if info is not None else {}
            tis = []
            for name, live in module._parameters.items():
                meta = metas.get(name)
                if live is not None and meta is not None and tuple(meta.shape) != tuple(live.shape):
                    # Packed away (vLLM left an empty placeholder): load into the checkpoint-format tensor.
                    like = materialize_meta_tensor(restore_layer_refs(to_meta_tensor(meta), module))
                    targets.append([module, name, None, like, live])
                    owners.append([])
                    tis.append(len(targets) - 1)
                elif live is not None and live.numel() > 0:
                    ti = storage.setdefault(live.untyped_storage().data_ptr(), len(targets))
                    if ti == len(targets):
                        targets.append([module, name, live, None, live])
                        owners.append([])
                    tis.append(ti)
            if tis:
                for ti in tis:
                    owners[ti].append(len(layers))
                layers.append([module, tis, _repacks(model, module)])
        for module, name, live, like, _ in targets:
            if live is None:
                module.register_parameter(name, like)
        storage.update({t[3].untyped_storage().data_ptr(): i for i, t in enumerate(targets) if t[2] is None})
        for buffer in model.buffers():   # a loader that writes a buffer cannot be replayed: the plan notes it
            if buffer.numel() > 0:
                storage.setdefault(buffer.untyped_storage().data_ptr(), -1)
        recorder = _recorder(storage)
        try:
            with recorder:
                model.load_weights(recorder.feed(stream))
        except BaseException:
            for module, name, live, _, original in targets:
                if live is None:
                    module.register_parameter(name, original)
            raise
        plan = cls(targets, owners, layers, recorder.entries)
        why = recorder.problem or plan._check(names)
        staged = {}
        for ti, (module, name, live, like, original) in enumerate(targets):
            if live is None:
                written = plan._covered(ti)
                if written is False:
                    module.register_parameter(name, original)  # not in this state dict: keep what it had
                    continue
                if written is None:
                    raise RuntimeError(f"weight load: {type(model).__name__}'s loaders filled only part of "
                                       f"{name} of {type(module).__name__}; its packed weight would be garbage")
                staged[ti] = like
        for li, (module, tis, repack) in enumerate(layers):
            if repack and plan.counts[li] and max(plan._like(ti).numel() for ti in tis) <= plain_max:
                plan._unpack(li, staged)
            if plan.counts[li]:
                plan._finish(li, staged, installed=True)
        return (None, why) if why else (plan, "")

    def usable(self, names: list[str]) -> bool:
        """The same names as recorded, each once, and the model still holds the recorded tensors."""
        return (len(names) == len(self.entries) and all(n in self.entries for n in names)
                and all(t[2] is None or getattr(t[0], t[1]) is t[2] for t in self.targets))

    def load(self, stream: Any, borrow: bool = False) -> None:
        """Copy each (name, tensor) to where it was recorded to go (nothing to
        copy when it was received there, see `destination`); repack each packed
        layer when its last slice is in. `borrow`: the stream's tensors stay
        valid until the load returns; a packed layer's weight whose slices lie
        in one buffer exactly as the weight lays them out (a flat buffer or an
        arena holds q, k and v back to back) is repacked from there, uncopied."""
        left, seen = list(self.counts), set()
        self.staged, self.repack_s, self.borrowed = {}, 0.0, set()
        pending: dict[int, list] = {}   # target -> its slices so far, until it is complete
        try:
            for name, tensor in stream:
                if name in seen or name not in self.entries:
                    raise RuntimeError(f"weight load: {name!r} "
                                       f"{'came twice' if name in seen else 'was not announced'}")
                seen.add(name)
                for write in self.entries[name]:
                    ti, done = write[0], 1
                    if borrow and self._borrowable(ti):
                        slices = pending.setdefault(ti, [])
                        slices.append((write, tensor))
                        if len(slices) < self.target_writes[ti]:
                            continue   # its layers cannot finish before it is complete
                        done = len(slices)
                        self._stage(ti, pending.pop(ti))
                    else:
                        self._write(ti, write, tensor)
                    for li in self.owners[ti]:
                        left[li] -= done
                        if left[li] == 0:
                            self._finish(li, self.staged)
        finally:
            self.uncopied = len(self.borrowed)
            self.staged, self.borrowed = None, set()
        if len(seen) != len(self.entries):
            raise RuntimeError(f"weight load: the stream ended after {len(seen)} of {len(self.entries)} tensors")

    def destination(self, name: str, dtype: Any, nbytes: int) -> Any:
        """During a load: the contiguous tensor where `name` goes whole (its
        bytes can be received right there, saving a copy), or None when it is
        spread, converted or filled around."""
        writes = self.entries.get(name)
        if self.staged is None or not writes or len(writes) != 1 or writes[0][4] is not None:
            return None
        ti, offset, size, stride, _ = writes[0]
        base = self._base(ti)
        view = base.as_strided(size, stride, offset)
        if base.dtype != dtype or not view.is_contiguous() or view.numel() * view.element_size() != nbytes:
            return None
        return view

    def _borrowable(self, ti: int) -> bool:
        """A staged target that only vLLM's repacking reads (its layers drop the plain weight after)."""
        return (self.targets[ti][2] is None and ti not in self.filled
                and all(self.layers[li][2] for li in self.owners[ti]))

    def _stage(self, ti: int, slices: list) -> None:
        """Target `ti`, complete: staged as a view of the stream's buffer if its
        slices lie there as the target lays them out, else copied into a staging tensor."""
        like = self.targets[ti][3]
        (_, offset, _, _, _), first = slices[0]
        shift, storage = first.storage_offset() - offset, first.untyped_storage()
        extent = sum((n - 1) * st for n, st in zip(like.shape, like.stride())) + 1
        if shift >= 0 and (shift + extent) * like.element_size() <= storage.nbytes() and all(
                t.dtype == like.dtype and t.untyped_storage().data_ptr() == storage.data_ptr()
                and t.storage_offset() - off == shift and tuple(t.shape) == tuple(size)
                and tuple(t.stride()) == tuple(stride) for (_, off, size, stride, _), t in slices):
            self.staged[ti] = first.as_strided(like.shape, like.stride(), shift)
            self.borrowed.add(ti)
            return
        for write, tensor in slices:
            self._write(ti, write, tensor)

    def _write(self, ti: int, write: tuple, tensor: Any) -> None:
        _, offset, size, stride, fill = write
        view = self._base(ti).as_strided(size, stride, offset)
        if fill is not None:
            view.fill_(fill)
        elif not _same_view(view, tensor):
            view.copy_(tensor)

    def _base(self, ti: int) -> Any:
        base = self.targets[ti][2]
        if base is None:
            base = self.staged.get(ti)
            if base is None:
                base = self.staged[ti] = self._take(ti)
        return base

    # -- internals --------------------------------------------------------
    def _check(self, names: list[str]) -> str:
        if sorted(self.entries) != sorted(names) or len(set(names)) != len(names):
            return "the model's loaders did not take each announced tensor exactly once"
        return ""

    def _covered(self, ti: int) -> bool | None:
        """Whether the recorded writes fill target `ti` completely (True), not at all (False), or in part (None)."""
        import torch
        like = self.targets[ti][3]
        mask = torch.zeros(like.untyped_storage().nbytes() // like.element_size(), dtype=torch.bool)
        for writes in self.entries.values():
            for t, offset, size, stride, _ in writes:
                if t == ti:
                    mask.as_strided(size, stride, offset).fill_(True)
        window = mask.as_strided(like.shape, like.stride(), like.storage_offset())
        return True if bool(window.all()) else (False if not bool(window.any()) else None)

    def _like(self, ti: int) -> Any:
        return self.targets[ti][3] if self.targets[ti][2] is None else self.targets[ti][2]

    def _unpack(self, li: int, staged: dict) -> None:
        """Keep the plain weight as the layer's weight and multiply with it
        (F.linear) instead of a oneDNN handle, so that a load is a copy. Creating
        a handle costs at least 0.55 ms whatever the size, nine of them were 3.5 ms
        of the tiny model's 5 ms load, and for layers this small F.linear was as
        fast as oneDNN at every batch size measured (1 to 512 rows). The layer's
        method becomes one whose post-load step keeps it so, which vLLM's own
        reload_weights then runs too (it would pack it again and then fail to
        copy the empty placeholder into the plain weight)."""
        module, tis, _ = self.layers[li]
        for ti in tis:
            if ti in staged:
                self.targets[ti][2] = staged.pop(ti)
                module.register_parameter(self.targets[ti][1], self.targets[ti][2])
        module.quant_method.__class__ = _plain_method(type(module.quant_method))
        module.quant_method.process_weights_after_loading(module)
        self.layers[li][2] = False

    def _take(self, ti: int) -> Any:
        import torch
        like = self.targets[ti][3]
        free = self.pool.get((like.shape, like.stride(), like.dtype))
        return free.pop() if free else torch.empty_strided(like.shape, like.stride(), dtype=like.dtype)

    def _finish(self, li: int, staged: dict, installed: bool = False) -> None:
        import torch
        module, tis, repack = self.layers[li]
        params = {}
        for ti in tis:
            if ti in staged:
                params[ti] = staged[ti] if installed else torch.nn.Parameter(staged[ti], requires_grad=False)
                module.register_parameter(self.targets[ti][1], params[ti])
        if repack:
            started = time.perf_counter()
            module.quant_method.process_weights_after_loading(module)
            self.repack_s += time.perf_counter() - started
        for ti, param in params.items():
            buffer = staged.pop(ti)
            if getattr(module, self.targets[ti][1]) is param:
                if ti in self.borrowed:
                    raise RuntimeError(f"weight load: {type(module).__name__} kept the loaded tensor "
                                       f"{self.targets[ti][1]} as its weight after a repack it had not kept before")
                self.targets[ti][2] = param  # vLLM kept the plain tensor as the weight: write there from now on
            elif ti not in self.borrowed:
                like = self.targets[ti][3]
                self.pool.setdefault((like.shape, like.stride(), like.dtype), []).append(buffer.detach())


def _plain_linear(x: Any, weight: Any, bias: Any) -> Any:
    import torch
    return torch.nn.functional.linear(x, weight, bias)


_PLAIN: dict = {}


def _plain_method(cls: type) -> type:
    """`cls` (vLLM's unquantized linear or embedding method) with a post-load step that keeps the weight plain."""
    if getattr(cls, "keeps_plain", False):
        return cls
    if cls not in _PLAIN:
        def process_weights_after_loading(self, layer):
            layer.cpu_linear = _plain_linear
        _PLAIN[cls] = type(f"Plain{cls.__name__}", (cls,), {
            "keeps_plain": True, "process_weights_after_loading": process_weights_after_loading})
    return _PLAIN[cls]


def _repacks(model: Any, module: Any) -> bool:
    """Whether vLLM keeps this layer's weight in a kernel format that a load must rebuild.
    Only CPU layers have `cpu_linear`; an input embedding has one too, unused unless it is the LM head."""
    if not hasattr(module, "cpu_linear"):
        return False
    return type(module).__name__ != "VocabParallelEmbedding" or getattr(model, "lm_head", None) is module


def _recorder(storage: dict) -> Any:
    """A dispatch mode that notes every write into the storages in `storage`
    (data pointer -> target) while `load_weights` runs: a copy of the tensor
    being loaded, a fill (vocabulary padding), or anything else (which makes
    the plan unusable: a loader that computes cannot be replayed as copies)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    aten = torch.ops.aten

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.entries: dict = {}
            self.problem, self.name, self.source = "", None, None

        def feed(self, stream: Any) -> Any:
            for name, tensor in stream:
                self.name, self.source = name, tensor
                self.entries.setdefault(name, [])
                yield name, tensor

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                dst = args[i] if i < len(args) else kwargs.get(arg.name)
                if not isinstance(dst, torch.Tensor) or dst.numel() == 0:
                    continue
                ti = storage.get(dst.untyped_storage().data_ptr())
                if ti is None:
                    continue
                where = (ti, dst.storage_offset(), tuple(dst.shape), tuple(dst.stride()))
                if ti < 0:
                    self.problem = self.problem or f"{func} writes a buffer while loading {self.name!r}"
                elif self.name is None:
                    self.problem = self.problem or f"{func} wrote a parameter outside any tensor's load"
                elif func is aten.copy_.default and _same_view(args[1], self.source):
                    self.entries[self.name].append((*where, None))
                elif func in (aten.fill_.Scalar, aten.zero_.default):
                    self.entries[self.name].append((*where, args[1] if len(args) > 1 else 0))
                else:
                    self.problem = self.problem or f"{func} writes a parameter while loading {self.name!r}"
            return func(*args, **kwargs)

    return Recorder()


def _same_view(a: Any, b: Any) -> bool:
    return (b is not None and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
            and tuple(a.shape) == tuple(b.shape) and tuple(a.stride()) == tuple(b.stride()))
