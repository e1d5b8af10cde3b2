"""Tokenizers and the input pipeline."""

import json
import string

import numpy as np
import pytest

from trace_jax.data.pipeline import left_pad, record_batches, supervised_batch
from trace_jax.data.tokenizer import (CharTokenizer, HFTokenizer, load_tokenizer,
                                      load_tokenizer_json)

# the special tokens and chat template of Qwen3's tokenizer, over a character vocabulary
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHARS = string.digits + "+-*/=()." + string.ascii_lowercase + " \n"


def write_hf_tokenizer(directory, chars=CHARS) -> None:
  """A checkpoint's tokenizer files: tokenizer.json (WordLevel over single characters, Qwen3's
  special tokens first), tokenizer_config.json (eos <|im_end|>, pad <|endoftext|>, the chat
  template) and generation_config.json's eos_token_id (both)."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

  vocab = {t: i for i, t in enumerate(SPECIALS + sorted(set(chars)))}
  tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[0]))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(SPECIALS)
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|endoftext|>",
       "chat_template": CHAT, "model_max_length": 8}))
  gen = directory / "generation_config.json"
  raw = json.loads(gen.read_text()) if gen.exists() else {}
  gen.write_text(json.dumps({**raw, "eos_token_id": [2, 0]}))


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


def test_a_checkpoints_tokenizer_its_stops_and_chat_template(tmp_path):
  pytest.importorskip("tokenizers")
  pytest.importorskip("jinja2")
  write_hf_tokenizer(tmp_path)
  tok = load_tokenizer(str(tmp_path))
  assert isinstance(tok, HFTokenizer)
  assert (tok.eos_id, tok.pad_id, tok.stop_ids) == (2, 0, (2, 0))
  ids = tok.encode("12+7=")
  assert len(ids) == 5 and tok.decode(ids + [0, 5]) == tok.decode(ids + [2, 5]) == "12+7="
  chat = tok.chat("12+7=")
  assert chat == "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"
  assert tok.encode(chat)[:1] == [1] and tok.encode(chat).count(2) == 1  # specials: one token
  # a checkpoint's metadata and a run's workdir give the same tokenizer back
  (tmp_path / "saved").mkdir()
  tok.save(str(tmp_path / "saved"))
  for again in (load_tokenizer_json(json.loads(json.dumps(tok.to_json()))),
                load_tokenizer(str(tmp_path / "saved"))):
    assert again.encode(chat) == tok.encode(chat) and again.chat("1") == tok.chat("1")
    assert (again.eos_id, again.pad_id, again.stop_ids) == (2, 0, (2, 0))
  b = supervised_batch(tok, [chat], [[("19", True), ("<eos>", True)]], 24, 3)
  assert tok.decode(b["tokens"][0, 24:]) == "19" and b["tokens"][0, 26] == 2

  (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
  with pytest.raises(ValueError, match="eos_token '</s>' is not in the vocabulary"):
    load_tokenizer(str(tmp_path))
  (tmp_path / "tokenizer_config.json").write_text("{}")
  with pytest.raises(ValueError, match="has no chat template"):
    load_tokenizer(str(tmp_path)).chat("1")


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
