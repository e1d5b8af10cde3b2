"""HumanEval generation from a Hugging Face checkpoint (a tiny random one, built offline)."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from trace_jax import evaluate_humaneval  # noqa: E402
from trace_jax.tasks.coding import humaneval_problems  # noqa: E402


def test_truncate_at_stop_sequences():
  body = "    return x + 1\n"
  assert evaluate_humaneval.truncate(body + "\ndef g():\n  pass") == body
  assert evaluate_humaneval.truncate(body) == body


def test_humaneval_from_a_tiny_hf_checkpoint(tmp_path, allow_unsandboxed):
  texts = [p["prompt"] + p["canonical_solution"] for p in humaneval_problems()[:40]]
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<|endoftext|>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  cfg = transformers.Qwen3MoeConfig(
      vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
      moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
  torch.manual_seed(0)
  transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path)
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
  result = evaluate_humaneval.evaluate(str(tmp_path), precision="mxfp4", limit=3,
                                       max_new_tokens=12, batch=2,
                                       allow_unsandboxed=allow_unsandboxed)
  assert result["n"] == 3 and len(result["results"]) == 3
  assert result["pass@1"] == 0.0  # a random policy writes no working code
  assert all(isinstance(r["completion"], str) for r in result["results"])
