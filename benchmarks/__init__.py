"""The benchmarks, one module each, run from the repository root as
`python -m benchmarks.NAME` (`--help` says what each measures and how long it
takes). benchmarks/harness.py is what they share to run and record (a local
Ray, machine info, the result file, tables); benchmarks/workloads.py what more
than one of them runs. Results go to benchmarks/results/NAME.json.

Nothing is imported here: benchmarks.trl_grpo runs in TRL's own venv, and the
GPU benchmarks must start without Ray or vLLM.
"""
