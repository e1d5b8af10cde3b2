"""Rollouts, the training path and the RL loop."""
