"""On-policy distillation: the teacher model that scores every model token of a rollout batch."""
