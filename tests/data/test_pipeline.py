"""Tokenizers and the input pipeline."""

import numpy as np
import pytest

from trace_jax.data.pipeline import left_pad, record_batches, supervised_batch
from trace_jax.data.tokenizer import CharTokenizer, load_tokenizer, load_tokenizer_json


def test_char_tokenizer_round_trip_and_save(tmp_path):
  tok = CharTokenizer("0123456789+=")
  ids = tok.encode("12+7=")
  assert min(ids) > tok.eos_id and tok.decode(ids + [tok.eos_id, 5, 6]) == "12+7="
  tok.save(str(tmp_path))
  again = load_tokenizer(str(tmp_path))
  assert again.vocab == tok.vocab and load_tokenizer_json(tok.to_json()).vocab == tok.vocab
  with pytest.raises(ValueError, match=r"characters \['x'\] are not in the tokenizer"):
    tok.encode("1x")


def test_run_tokenizer_json_is_a_hugging_face_tokenizer(tmp_path):
  """The tokenizer.json a run writes loads with `tokenizers` and `transformers`, which give the
  run's own ids for any text of its alphabet (spaces and newlines too) and decode them back;
  <pad>, <bos> and <eos> are its special tokens 0, 1, 2."""
  tokenizers = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  tok = CharTokenizer("0123456789+=;> \nxy()*-")
  path = tok.save(str(tmp_path))
  hf = tokenizers.Tokenizer.from_file(path)
  fast = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
  rng = np.random.default_rng(0)
  alphabet = tok.vocab[3:]
  for _ in range(50):
    text = "".join(rng.choice(alphabet, size=rng.integers(1, 40)))
    ids = tok.encode(text)
    assert hf.encode(text, add_special_tokens=False).ids == ids
    assert fast.encode(text, add_special_tokens=False) == ids
    assert hf.decode(ids) == text and fast.decode(ids) == text
  assert [hf.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]
  assert hf.decode([1, *tok.encode("1+2"), 2, 0]) == "1+2"  # specials skipped
  again = load_tokenizer(str(tmp_path))
  assert isinstance(again, CharTokenizer) and again.vocab == tok.vocab


def test_hf_tokenizer_file(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  model = tokenizers.models.WordLevel({"<eos>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]")
  hf = tokenizers.Tokenizer(model)
  hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  hf.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
  tok = load_tokenizer(str(tmp_path))
  assert tok.encode("a b a") == [1, 2, 1] and tok.eos_id == 0
  assert tok.decode([1, 2, 0, 1]) == "a b"


def test_left_pad_and_supervised_batch():
  tokens, lengths = left_pad([[5, 6], [7]], 4, 0)
  np.testing.assert_array_equal(tokens, [[0, 0, 5, 6], [0, 0, 0, 7]])
  with pytest.raises(ValueError, match="5 tokens does not fit the configured width 4"):
    left_pad([[1] * 5], 4, 0)
  tok = CharTokenizer("0123456789+=")
  b = supervised_batch(tok, ["1+2=", "3="], [[("3", True), ("<eos>", True)],
                                              [("10", True), ("<eos>", True)]], 5, 3)
  assert b["tokens"].shape == (2, 8)
  assert tok.decode(b["tokens"][0, 5:]) == "3" and tok.decode(b["tokens"][1, 5:]) == "10"
  np.testing.assert_array_equal(b["loss_mask"][1], [0, 0, 0, 0, 0, 1, 1, 1])
  np.testing.assert_array_equal(b["valid"][1], [0, 0, 0, 1, 1, 1, 1, 1])
  with pytest.raises(ValueError, match="needs at least 4 positions, the rollout has 3"):
    supervised_batch(tok, ["1="], [[("123", True), ("<eos>", True)]], 5, 3)
  # environment segments are context, not targets
  b = supervised_batch(tok, ["1="], [[("2", True), ("+3", False), ("5", True)]], 3, 4)
  np.testing.assert_array_equal(b["loss_mask"][0, 3:], [1, 0, 0, 1])


def test_record_batches_are_addressed_by_step():
  source = [{"i": i} for i in range(10)]
  batches = record_batches(source, 4, seed=0)
  first = [[r["i"] for r in batches[s]] for s in range(5)]
  again = record_batches(source, 4, seed=0)
  assert first == [[r["i"] for r in again[s]] for s in range(5)]
  seen = sorted(sum(first, [])[:10])
  assert seen == list(range(10))  # an epoch covers every record once
  with pytest.raises(ValueError, match="empty"):
    record_batches([], 4, seed=0)
