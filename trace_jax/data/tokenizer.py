"""Tokenizers: a small offline character tokenizer saved with each checkpoint, and Hugging Face
`tokenizer.json` files for imported checkpoints. Both read and write `tokenizer.json` in the
Hugging Face format (the character one as a `tokenizers` WordLevel model over single
characters), so a run's tokenizer loads with `tokenizers` and `transformers` too."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


class CharTokenizer:
  """One token per character of a fixed alphabet, plus <pad>=0, <bos>=1, <eos>=2.

  Small tasks (arithmetic, short programs) need no subword merges: a character vocabulary keeps
  the embedding table tiny and makes every answer digit its own decision.
  """

  kind = "char"

  def __init__(self, alphabet: Iterable[str]):
    chars = sorted(set(alphabet))
    bad = [c for c in chars if len(c) != 1]
    if bad:
      raise ValueError(f"alphabet entries must be single characters, got {bad[:5]}")
    self.vocab = [PAD, BOS, EOS] + chars
    self._index = {c: i for i, c in enumerate(self.vocab)}

  @classmethod
  def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
    return cls(set("".join(texts)))

  pad_id, bos_id, eos_id = 0, 1, 2

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  def encode(self, text: str) -> list[int]:
    missing = sorted({c for c in text if c not in self._index})
    if missing:
      raise ValueError(f"characters {missing} are not in the tokenizer's alphabet "
                       f"({''.join(self.vocab[3:])!r})")
    return [self._index[c] for c in text]

  def decode(self, ids: Sequence[int]) -> str:
    """Text up to the first <eos>; <pad> and <bos> are dropped."""
    out = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if i > self.eos_id:
        out.append(self.vocab[i])
    return "".join(out)

  def to_json(self) -> dict:
    """The compact form checkpoints carry in their metadata (`load_tokenizer_json`)."""
    return {"type": self.kind, "vocab": self.vocab}

  def hf_tokenizer(self):
    """The same vocabulary as a `tokenizers.Tokenizer`: every character its own pre-token
    (newlines and spaces too), looked up in a WordLevel model; <pad>, <bos>, <eos> its special
    tokens; decoding concatenates."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(self.vocab)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, BOS, EOS])
    return tok

  def save(self, directory: str) -> str:
    """Writes directory/tokenizer.json in the Hugging Face format (`hf_tokenizer`)."""
    path = os.path.join(directory, "tokenizer.json")
    self.hf_tokenizer().save(path)
    return path

  @classmethod
  def from_hf_json(cls, raw: dict) -> CharTokenizer | None:
    """The character tokenizer a Hugging Face tokenizer.json holds, or None where it holds
    another kind (a WordLevel model over <pad>, <bos>, <eos> and single characters)."""
    model = raw.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "WordLevel" or not isinstance(vocab, dict):
      return None
    order = sorted(vocab, key=vocab.get)
    if order[:3] != [PAD, BOS, EOS] or any(len(t) != 1 for t in order[3:]):
      return None
    return load_tokenizer_json({"type": cls.kind, "vocab": order})


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer (the tokenizer.json of an imported checkpoint)."""

  kind = "hf"

  def __init__(self, path: str, eos_token: str | None = None, pad_token: str | None = None):
    from tokenizers import Tokenizer

    self._tok = Tokenizer.from_file(path)
    self._path = path
    vocab = self._tok.get_vocab()
    self.eos_id = vocab.get(eos_token) if eos_token else None
    self.pad_id = vocab.get(pad_token, self.eos_id) if pad_token else self.eos_id
    self.bos_id = None

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    ids = [int(i) for i in ids]
    if self.eos_id is not None and self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    return self._tok.decode(ids)

  def save(self, directory: str) -> str:
    path = os.path.join(directory, "tokenizer.json")
    self._tok.save(path)
    return path


def load_tokenizer_json(raw: dict) -> CharTokenizer:
  """A character tokenizer from its `to_json()` form (as saved in checkpoints)."""
  if raw.get("type") != CharTokenizer.kind or raw.get("vocab", [])[:3] != [PAD, BOS, EOS]:
    raise ValueError(f"not a saved character tokenizer: {str(raw)[:80]}")
  tok = CharTokenizer(raw["vocab"][3:])
  if tok.vocab != raw["vocab"]:
    raise ValueError("malformed character vocabulary: not sorted unique characters")
  return tok


def load_tokenizer(directory: str):
  """The tokenizer saved in `directory/tokenizer.json` (either kind)."""
  path = os.path.join(directory, "tokenizer.json")
  if not os.path.exists(path):
    raise ValueError(f"no tokenizer.json in {directory}")
  with open(path) as fh:
    raw = json.load(fh)
  if raw.get("type") == CharTokenizer.kind:  # written before runs saved the HF format
    return load_tokenizer_json(raw)
  char = CharTokenizer.from_hf_json(raw)
  if char is not None:
    return char
  config = {}
  cfg_path = os.path.join(directory, "tokenizer_config.json")
  if os.path.exists(cfg_path):
    with open(cfg_path) as fh:
      config = json.load(fh)
  token = lambda v: v.get("content") if isinstance(v, dict) else v
  return HFTokenizer(path, eos_token=token(config.get("eos_token")),
                     pad_token=token(config.get("pad_token")))
