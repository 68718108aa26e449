"""training.dtype auto: the bf16 units found in /proc/cpuinfo, what auto picks
from them, the run's line about them, and the trainer's own resolution as the
summary reads it from its worker_ready event."""
from __future__ import annotations

import json

import pytest

from pipeline.config import load_config
from pipeline.config.load import ConfigError
from pipeline.core.precision import cpu_bf16_flags, describe_cpu, resolve_dtype
from pipeline.run.driver import _trained_dtype

pytestmark = pytest.mark.unit

X86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 avx512f {extra}\nbogomips\t: 4000\n"


@pytest.mark.parametrize("extra,found", [
    ("amx_bf16 amx_tile avx512_bf16", ("amx_bf16", "avx512_bf16")),
    ("avx512_bf16", ("avx512_bf16",)),
    ("amx_int8 avx512_vnni", ()),  # AMX without its bf16 part is no bf16 unit
    ("", ()),
])
def test_the_bf16_units_are_read_from_the_flags_line(tmp_path, extra, found):
    # Two processors, as /proc/cpuinfo lists them: the first flags line decides.
    info = tmp_path / "cpuinfo"
    info.write_text(X86.format(extra=extra) + "\n" + X86.format(extra="amx_bf16"))
    assert cpu_bf16_flags(info) == found


def test_a_machine_without_proc_cpuinfo_has_no_bf16_units(tmp_path):
    assert cpu_bf16_flags(tmp_path / "absent") == ()


@pytest.mark.parametrize("requested,cuda,cuda_bf16,flags,dtype", [
    ("auto", False, False, ("amx_bf16",), "bf16"),
    ("auto", False, False, (), "fp32"),
    ("auto", True, True, (), "bf16"),       # the GPU decides, not the host CPU
    ("auto", True, False, ("amx_bf16",), "fp32"),
    ("fp32", False, False, ("amx_bf16",), "fp32"),  # asked for: kept
    ("bf16", False, False, (), "bf16"),
])
def test_auto_picks_bf16_only_where_the_device_has_it(requested, cuda, cuda_bf16, flags, dtype):
    assert resolve_dtype(requested, cuda=cuda, cuda_bf16=cuda_bf16, cpu_flags=flags) == dtype


def test_an_unknown_dtype_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="training.dtype must be one of fp32, bf16, auto, got 'fp16'"):
        resolve_dtype("fp16", cuda=False, cuda_bf16=False, cpu_flags=())
    with pytest.raises(ValueError, match="generation.dtype must be one of"):
        resolve_dtype("fp16", cuda=False, cuda_bf16=False, cpu_flags=(), key="generation.dtype")
    for key in ("training.dtype", "generation.dtype"):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [f"{key}=fp16"])
    cfg = load_config(None, ["training.dtype=auto", "generation.dtype=bf16"])
    assert (cfg.training.dtype, cfg.generation.dtype) == ("auto", "bf16")


def test_the_run_line_says_what_was_found_and_what_a_cpu_trainer_uses():
    assert describe_cpu("auto", ("amx_bf16", "avx512_bf16")) == (
        "dagrl: this machine's CPU has bf16 units amx_bf16, avx512_bf16; training.dtype auto -> bf16 on a CPU trainer")
    assert describe_cpu("fp32", ("avx512_bf16",)).endswith("fp32 on a CPU trainer; training.dtype=auto would pick bf16")
    line = describe_cpu("auto", ())
    assert "no bf16 units (none of amx_bf16, avx512_bf16)" in line and line.endswith("auto -> fp32 on a CPU trainer")
    assert describe_cpu("bf16", ()).endswith("bf16 is emulated here, slower than fp32")


def test_the_summary_takes_the_dtype_trainer_rank_0_resolved(tmp_path):
    events = tmp_path / "events"
    events.mkdir()
    assert _trained_dtype(tmp_path) is None  # a simulated run has no trainer log
    for name, dtype in (("trainer0", "bf16"), ("trainer1", "fp32")):
        (events / f"{name}.jsonl").write_text("\n".join(json.dumps(e) for e in (
            {"ev": "worker_start", "pid": 1}, {"ev": "worker_ready", "dtype": dtype}, {"ev": "train_start"})) + "\n")
    assert _trained_dtype(tmp_path) == "bf16"
