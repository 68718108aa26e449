"""Rewards: the functions a recipe names and how a spec finds them, one
sample's score and its failure, a group's fill of its failed rewards, and a
reward model's score added to the rule's. The reward model's actor, which
runs a model of its own, is pipeline/reward_model/."""
