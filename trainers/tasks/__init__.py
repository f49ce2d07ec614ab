"""Example tasks for the shared trainer: `trainers.tasks.lm` (GPT-style LM) and `trainers.tasks.classifier`."""
