"""Fits that save the same bytes on every x86 CPU.

The matmul and elementwise kernels round differently per instruction set
(AVX2, AVX-512, AMX) and thread count, and training is chaotic: a last-bit
difference grows into other weights within a few hundred AdamW steps, in
float64 as in float32. So a fit here runs in float64 on one thread and,
after every optimizer step, rounds the parameters to multiples of GRID and
the optimizer's state to STATE_BITS significant bits: the kernels' float64
differences (around 1e-16 relative) vanish in each rounding before they
can grow. The saved weights are on the grid, so float32 holds them exactly.

What it holds for: ATen's AVX2 and AVX-512 kernels (what it dispatches to on
any x86 CPU with AVX2), MKL and oneDNN capped at AVX2, any thread count.
Not ATen's scalar kernels (ATEN_CPU_CAPABILITY=default, CPUs without AVX2):
the 400-step tiny reward model fit came out different under them. Nor what
a model computes in float32 inside a float64 fit: LlamaForCausalLM's own
loss upcasts the logits to float32 and made the calculator warm-up differ
under ATen's AVX2 kernels (so the warm-up takes its loss on the float64
logits); the Llama's RMSNorm and rotary embeddings, also float32 inside,
have not made a fit differ under the settings tests/inputs tries.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# A power of two, so rounding is exact and every multiple fits float32; far below an AdamW
# step (about lr, 1e-3) and the tiny models' weights (init std 0.02).
GRID = 2.0 ** -16
# The optimizer's moments span many magnitudes, so they keep significant bits instead.
STATE_BITS = 12


@contextmanager
def portable_fit(model: Any, make_optimizer: Callable[[Any], Any]) -> Iterator[Any]:
    """Yields make_optimizer(model.parameters()) for the block to fit `model`
    with: float64, one thread, every step rounded; afterwards float32 again."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.to(torch.float64)
    optimizer = make_optimizer(model.parameters())
    hook = optimizer.register_step_post_hook(lambda opt, args, kwargs: round_fit_state(opt))
    try:
        yield optimizer
    finally:
        hook.remove()
        torch.set_num_threads(threads)
    model.to(torch.float32)


def round_parameters(params: Any) -> None:
    import torch
    with torch.no_grad():
        for p in params:
            p.copy_(torch.round(p / GRID) * GRID)


def round_fit_state(optimizer: Any) -> None:
    """Round the parameters to GRID and every floating-point tensor of the optimizer's state to STATE_BITS."""
    import torch
    params = [p for group in optimizer.param_groups for p in group["params"]]
    round_parameters(params)
    with torch.no_grad():
        for p in params:
            for value in optimizer.state[p].values():
                if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0:
                    mantissa, exponent = torch.frexp(value)
                    value.copy_(torch.ldexp(torch.round(mantissa * 2 ** STATE_BITS) / 2 ** STATE_BITS, exponent))
