"""Reward models: a sequence classifier or an LLM judge that scores rollouts on an actor of its own."""
