"""Loading Hugging Face Qwen3-MoE checkpoints (placeholder until written)."""


def load_hf(path, dtype=None):
  raise NotImplementedError
