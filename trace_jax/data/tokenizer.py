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
  stop_ids = (eos_id,)

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


def _token(value):
  """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
  return value.get("content") if isinstance(value, dict) else value


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as fh:
    return json.load(fh)


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer (an imported checkpoint's tokenizer.json) with what
  its directory says around it: the eos and pad tokens (tokenizer_config.json), the tokens
  generation stops at (the eos token and generation_config.json's eos_token_id) and the chat
  template. Its `to_json()` carries all of it, so a run's checkpoint rebuilds it alone."""

  kind = "hf"
  CONFIG_KEYS = ("eos_token", "pad_token", "bos_token", "chat_template")

  def __init__(self, tokenizer_json: str, config: dict | None = None,
               generation_stops: Sequence[int] = ()):
    from tokenizers import Tokenizer

    self._json = tokenizer_json
    self._tok = Tokenizer.from_str(tokenizer_json)
    config = config or {}
    self.config = {k: config[k] if k == "chat_template" else _token(config[k])
                   for k in self.CONFIG_KEYS if config.get(k) is not None}
    vocab = self._tok.get_vocab()
    for key in ("eos_token", "pad_token"):
      if key in self.config and self.config[key] not in vocab:
        raise ValueError(f"tokenizer_config.json's {key} {self.config[key]!r} is not in the "
                         "vocabulary of tokenizer.json")
    self.eos_id = vocab.get(self.config.get("eos_token"))
    self.pad_id = vocab.get(self.config.get("pad_token"), self.eos_id)
    self.bos_id = None
    self.generation_stops = tuple(int(i) for i in generation_stops)
    self.stop_ids = tuple(dict.fromkeys(
        ([] if self.eos_id is None else [self.eos_id]) + list(self.generation_stops)))

  @classmethod
  def from_directory(cls, directory: str) -> HFTokenizer:
    """tokenizer.json, with tokenizer_config.json, generation_config.json and
    chat_template.jinja where present."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
      raise ValueError(f"no tokenizer.json in {directory}")
    with open(path) as fh:
      text = fh.read()
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
      template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.exists(jinja):
      with open(jinja) as fh:
        template = fh.read()
    config = {**config, "chat_template": template}
    stops = _read_json(os.path.join(directory, "generation_config.json")).get("eos_token_id")
    stops = [] if stops is None else [stops] if isinstance(stops, int) else list(stops)
    return cls(text, config, stops)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size()

  @property
  def chat_template(self) -> str | None:
    return self.config.get("chat_template")

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    """Text up to the first stop token."""
    ids = [int(i) for i in ids]
    cut = next((n for n, i in enumerate(ids) if i in self.stop_ids), len(ids))
    return self._tok.decode(ids[:cut])

  def chat(self, text: str) -> str:
    """`text` as the one user message of a conversation, followed by the assistant's turn, as
    the chat template renders it (Jinja in a sandbox, with the helpers transformers gives
    templates)."""
    if self.chat_template is None:
      raise ValueError("the tokenizer has no chat template (tokenizer_config.json's "
                       "chat_template or chat_template.jinja)")
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
      raise ValueError(f"the chat template refused the prompt: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False,
                                                                   indent=indent)
    env.globals["raise_exception"] = raise_exception
    tokens = {k: v for k, v in self.config.items() if k != "chat_template"}
    return env.from_string(self.chat_template).render(
        messages=[{"role": "user", "content": text}], add_generation_prompt=True, **tokens)

  def to_json(self) -> dict:
    """Everything the tokenizer is (checkpoints carry it in their metadata)."""
    return {"type": self.kind, "tokenizer_json": self._json, "config": self.config,
            "generation_stops": list(self.generation_stops)}

  def save(self, directory: str) -> str:
    """Writes directory/tokenizer.json (the checkpoint's own, unchanged), tokenizer_config.json
    (its eos, pad and bos tokens and chat template) and, where there are generation stops,
    generation_config.json's eos_token_id: `from_directory` reads the same tokenizer back."""
    path = os.path.join(directory, "tokenizer.json")
    with open(path, "w") as fh:
      fh.write(self._json)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as fh:
      json.dump(self.config, fh, indent=2)
    if self.generation_stops:
      with open(os.path.join(directory, "generation_config.json"), "w") as fh:
        json.dump({"eos_token_id": list(self.generation_stops)}, fh)
    return path


def load_tokenizer_json(raw: dict) -> CharTokenizer | HFTokenizer:
  """A tokenizer from its `to_json()` form (as saved in checkpoints)."""
  if raw.get("type") == HFTokenizer.kind:
    return HFTokenizer(raw["tokenizer_json"], raw["config"], raw["generation_stops"])
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
  return HFTokenizer.from_directory(directory)
