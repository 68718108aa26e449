"""dagrl: asynchronous GRPO on Ray, ordered by a step graph."""
