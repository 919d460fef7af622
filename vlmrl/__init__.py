"""vlmrl: GRPO-family RL for vision-language models."""
