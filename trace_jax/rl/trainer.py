"""The trainer: the ablation's modes, the optimizer, the warm-start step and the GRPO step.

Each step is one jitted program with its state donated. The GRPO step recomputes the rollout
batch with the trainer's numerics (for the PPO ratio, the rollout correction and the mismatch
metrics), then takes one optimizer step per minibatch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from trace_jax.models import layers as L
from trace_jax.models import stacks
from trace_jax.models.config import ModelConfig
from trace_jax.models.recipe import SITES, QuantRecipe, parse_layers
from trace_jax.quant import BF16
from trace_jax.rl import grpo
from trace_jax.rl.recompute import recompute

MODES = ("bf16", "fp4_rollout", "fp4_qat", "trace", "trace_all")
REMAT = ("none", "layer")
ATTENTIONS = tuple(L.ATTENTIONS)  # rl.attention: the trainer's (layers.ATTENTIONS)


@dataclasses.dataclass(frozen=True)
class ModeSetup:
  """What a mode means: the rollout's recipe, the trainer's recipe, the recorded layers."""

  rollout: QuantRecipe
  train: QuantRecipe
  records: str | tuple[int, ...]

  def check(self, n_layers: int) -> None:
    """Raises ValueError naming the first (recorded layer, site) whose record the trainer
    cannot be guided by: a record guides only the format it was made in (`guided_quant`), so
    where the trainer quantizes a recorded site the rollout must record it in that format."""
    for i in parse_layers(self.records, n_layers, what="records"):
      for site in SITES:
        train = self.train.site_format(site, i, n_layers)
        rollout = self.rollout.site_format(site, i, n_layers)
        if train is not BF16 and rollout != train:
          what = "nothing (bf16)" if rollout is BF16 else rollout.name
          raise ValueError(f"layer {i} {site}: the rollout records {what}, the trainer "
                           f"quantizes {train.name}")

  def layer_groups(self, n_layers: int) -> tuple[int, ...]:
    """Layers per stack of the master params (`init_params(groups=)`): runs of layers that both
    recipes treat alike and that get the same records, so that the programs of a run (the
    GRPO step, the weight sync) scan its stacks in place rather than copying parts of them."""
    recorded = parse_layers(self.records, n_layers, what="records")

    def signature(i):
      formats = [(r.weight_format(i, n_layers), tuple(r.site_format(s, i, n_layers)
                                                      for s in SITES))
                 for r in (self.train, self.rollout)]
      sites = tuple(s for s in SITES if i in recorded
                    and self.rollout.site_format(s, i, n_layers) is not BF16)
      return formats, sites

    return tuple(hi - lo for lo, hi in stacks.runs(n_layers, signature))


def mode_setup(mode: str, fp4: str = "mxfp4", trace_layers: str = "last:2",
               rollout_recipe: str = "", train_recipe: str = "") -> ModeSetup:
  """The modes, named presets of two recipes and the recorded layers. bf16: no quantization;
  fp4_rollout: `fp4` rollout, bf16 trainer; fp4_qat: `fp4` rollout, unguided QAT in `fp4`;
  trace: QAT guided by records of `trace_layers`; trace_all: every layer. `fp4` is any
  registered format (the name is the ablation's; fp8 or a user's format works too).
  rollout_recipe / train_recipe: `QuantRecipe.parse` specs that replace the mode's recipes
  (e.g. "weights=nvfp4,acts=mxfp4,kv=mxfp4"), the mode still choosing the records. In a
  recorded layer the trainer quantizes each site in the rollout's format or not at all
  (`ModeSetup.check`; validate refuses other pairs before any work)."""
  if mode not in MODES:
    raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
  bf16, q = QuantRecipe(), QuantRecipe.uniform(fp4)
  setup = {
      "bf16": ModeSetup(bf16, bf16, "none"),
      "fp4_rollout": ModeSetup(q, bf16, "none"),
      "fp4_qat": ModeSetup(q, q, "none"),
      "trace": ModeSetup(q, q, trace_layers),
      "trace_all": ModeSetup(q, q, "all"),
  }[mode]
  return ModeSetup(QuantRecipe.parse(rollout_recipe) if rollout_recipe else setup.rollout,
                   QuantRecipe.parse(train_recipe) if train_recipe else setup.train,
                   setup.records)


def make_optimizer(lr_sft: float, lr_rl: float, sft_steps: int, *, sft_warmup: int = 0,
                   max_grad_norm: float = 1.0, weight_decay: float = 0.0,
                   b2: float = 0.99) -> optax.GradientTransformation:
  """AdamW with global-norm clipping; the warm start and RL have their own learning rates.
  `sft_warmup`: the warm start's rate rises linearly over its first steps, lr_sft x (step + 1)
  / sft_warmup, then stays at lr_sft (0: lr_sft from the first step)."""
  sft = (optax.linear_schedule(lr_sft / sft_warmup, lr_sft, sft_warmup - 1) if sft_warmup > 1
         else optax.constant_schedule(lr_sft))
  schedule = optax.join_schedules([sft, optax.constant_schedule(lr_rl)], [sft_steps])
  return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                     optax.adamw(schedule, b2=b2, weight_decay=weight_decay))


@dataclasses.dataclass(frozen=True)
class RLOptions:
  clip_eps: float = 0.2
  correction: str = "none"  # none | tis | mis
  correction_cap: float = 2.0
  kl_coef: float = 0.0
  aux_coef: float = 1e-3
  minibatches: int = 1
  routing_replay: bool = False
  temperature: float = 1.0
  remat: str = "none"  # none | layer: each layer's activations recomputed in the backward pass
  attention: str = "full"  # full | fused: the trainer's attention (layers.ATTENTIONS)
  sft_attention: str = "full"  # the warm start's (sft.attention)

  def __post_init__(self):
    if self.remat not in REMAT:
      raise ValueError(f"rl.remat={self.remat!r}: choose one of {REMAT}")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"rl.attention={self.attention!r}: choose one of {ATTENTIONS}")
    if self.sft_attention not in ATTENTIONS:
      raise ValueError(f"sft.attention={self.sft_attention!r}: choose one of {ATTENTIONS}")
    if self.correction not in grpo.CORRECTIONS:
      raise ValueError(f"rl.correction={self.correction!r}: choose one of {grpo.CORRECTIONS}")
    if self.minibatches < 1:
      raise ValueError(f"rl.minibatches must be >= 1, got {self.minibatches}")


def _masked_mean(x, mask):
  return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


class Trainer:
  """Jitted warm-start and GRPO steps for one model, mode and optimizer."""

  def __init__(self, cfg: ModelConfig, setup: ModeSetup, optimizer: optax.GradientTransformation,
               options: RLOptions):
    self.cfg, self.setup, self.opt, self.o = cfg, setup, optimizer, options
    self.record_layers = parse_layers(setup.records, cfg.n_layers, what="records")
    setup.check(cfg.n_layers)
    self.remat = options.remat == "layer"
    self.sft_step = jax.jit(self._sft_step, donate_argnums=(0,))
    self._rl_jit = jax.jit(self._rl_step, donate_argnums=(0,))

  def init_state(self, params) -> dict:
    return {"params": params, "opt_state": self.opt.init(params)}

  @staticmethod
  def with_reference(state) -> dict:
    """The state with its policy copied as the KL penalty's reference (`ref_params`): buffers
    of their own, as the policy's are donated to every step."""
    return {**state, "ref_params": jax.tree.map(jnp.copy, state["params"])}

  def _apply(self, state, grads):
    updates, opt_state = self.opt.update(grads, state["opt_state"], state["params"])
    return {**state, "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state}

  # -- supervised warm start (bf16, the same start for every mode) -----------------------------

  def _sft_step(self, state, batch):
    def loss_fn(params):
      out = recompute(self.cfg, params, batch["tokens"], batch["valid"], remat=self.remat,
                      attention=self.o.sft_attention)
      nll = -_masked_mean(out.logp, batch["loss_mask"])
      return nll + self.o.aux_coef * out.aux_loss, (nll, out.aux_loss)

    (_, (nll, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    state = self._apply(state, grads)
    return state, {"train/loss": nll, "train/aux_loss": aux,
                   "train/grad_norm": optax.tree_utils.tree_norm(grads)}

  # -- GRPO ------------------------------------------------------------------------------------

  def _forward(self, params, batch, recipe=None):
    # a recorded layer the rollout leaves unquantized has no records (ModeSetup.check)
    records = {i: batch["records"][i] for i in self.record_layers if i in batch["records"]}
    routes = batch["routes"] if self.o.routing_replay else None
    return recompute(self.cfg, params, batch["tokens"], batch["valid"],
                     recipe or self.setup.train, records=records, routes=routes,
                     temperature=self.o.temperature, rollout_routes=batch["routes"],
                     remat=self.remat, attention=self.o.attention)

  def rl_step(self, state, batch):
    """batch: tokens, valid, response_mask, logp (the rollout's), advantages [B], records,
    routes. Returns the new state, metrics, and the trainer's pre-update log-probs and routes
    (for the mismatch metrics). With rl.kl_coef > 0 the state holds `ref_params`
    (`with_reference`); they go in as an argument of their own, read by every step and
    donated to none."""
    ref_params = state.get("ref_params")
    if self.o.kl_coef > 0 and ref_params is None:
      raise ValueError(f"kl_coef={self.o.kl_coef} needs the reference policy in the state "
                       "(Trainer.with_reference)")
    policy = {k: v for k, v in state.items() if k != "ref_params"}
    policy, metrics, old = self._rl_jit(policy, batch, ref_params)
    if ref_params is not None:
      policy["ref_params"] = ref_params
    return policy, metrics, old

  def _reference_logp(self, ref_params, batch):
    # the reference is a fixed policy computed as itself: the rollout's records and routes
    # guide the recompute of the policy that made the rollout, not of this one
    out = recompute(self.cfg, ref_params, batch["tokens"], batch["valid"], self.setup.train,
                    temperature=self.o.temperature, attention=self.o.attention)
    return jax.lax.stop_gradient(out.logp)

  def _rl_step(self, state, batch, ref_params):
    old = self._forward(state["params"], batch)
    logp_old = jax.lax.stop_gradient(old.logp)
    weights = grpo.rollout_correction(logp_old, batch["logp"], self.o.correction,
                                      self.o.correction_cap)
    extra = {"logp_old": logp_old, "weights": weights}
    if self.o.kl_coef > 0:
      extra["logp_ref"] = self._reference_logp(ref_params, batch)
    mbs = _split(dict(batch, **extra), self.o.minibatches)

    def mb_step(state, mb):
      def loss_fn(params):
        out = self._forward(params, mb)
        loss, clip_frac = grpo.policy_loss(out.logp, mb["logp_old"], mb["advantages"],
                                           mb["response_mask"], mb["weights"], self.o.clip_eps)
        kl = (grpo.kl_k3(out.logp, mb["logp_ref"], mb["response_mask"])
              if self.o.kl_coef > 0 else jnp.zeros(()))
        total = loss + self.o.kl_coef * kl + self.o.aux_coef * out.aux_loss
        return total, {"train/loss": loss, "train/clip_frac": clip_frac, "train/kl_ref": kl,
                       "train/aux_loss": out.aux_loss}

      (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
      metrics["train/grad_norm"] = optax.tree_utils.tree_norm(grads)
      return self._apply(state, grads), metrics

    state, metrics = jax.lax.scan(mb_step, state, mbs)
    metrics = jax.tree.map(jnp.mean, metrics)
    metrics["train/correction_weight"] = _masked_mean(weights, batch["response_mask"])
    return state, metrics, {"logp": logp_old, "routes": old.routes}


def _split(batch: dict, n: int) -> dict:
  """Splits every array along its batch axis into n minibatches (a new leading axis).
  routes are [n_layers, B, ...]: their batch axis is 1."""
  def split(a, axis=0):
    b = a.shape[axis]
    if b % n:
      raise ValueError(f"a batch of {b} sequences does not split into {n} minibatches")
    a = jnp.moveaxis(a, axis, 0)
    a = a.reshape(n, b // n, *a.shape[1:])
    return jnp.moveaxis(a, 1, axis + 1)

  out = {k: jax.tree.map(split, v) for k, v in batch.items() if k != "routes"}
  out["routes"] = split(batch["routes"], axis=1)
  return out
