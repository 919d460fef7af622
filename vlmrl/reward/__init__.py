"""Reward functions loaded from user code, and the managers that run them."""
