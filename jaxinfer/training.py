"""Training the tiny byte-level models: an offline corpus, the MTP loss, a step.

Corpus: text every Python install has offline, the standard library's own
source (tests excluded) and its bundled documentation topics
(`pydoc_data/topics.py`), read as UTF-8 bytes. Files split into train and
held-out by a fixed hash of their path relative to the stdlib root, so the
split is the same on every machine with the same Python minor version.

Loss = next-token CE + mtp_weight * mean over depths k of the depth-k MTP
CE (DeepSeek-V3 §2.2, where the weight is lambda).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer.config import ModelConfig
from jaxinfer.kv.contexts import FullContext
from jaxinfer.models import mtp
from jaxinfer.models.transformer import head, trunk


def corpus_files(root: str | None = None) -> list[str]:
  """Sorted stdlib .py paths (no tests, no site-packages), relative to root."""
  root = root or sysconfig.get_paths()["stdlib"]
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    rel_dir = os.path.relpath(dirpath, root)
    parts = rel_dir.split(os.sep)
    if any(p in ("site-packages", "test", "tests", "idle_test", "__pycache__") for p in parts):
      dirnames[:] = []
      continue
    out += [os.path.normpath(os.path.join(rel_dir, f)) for f in filenames if f.endswith(".py")]
  return sorted(out)


def is_held_out(rel_path: str, fraction: float = 0.05) -> bool:
  """Fixed split: a file is held out when the hash of its path says so."""
  h = int.from_bytes(hashlib.blake2b(rel_path.encode(), digest_size=8).digest(), "little")
  return h % 10_000 < fraction * 10_000


def load_corpus(held_out: bool, root: str | None = None, fraction: float = 0.05):
  """-> (uint8 bytes of the chosen files joined by a blank line, file list)."""
  root = root or sysconfig.get_paths()["stdlib"]
  files = [f for f in corpus_files(root) if is_held_out(f, fraction) == held_out]
  if not files:
    raise ValueError(f"no {'held-out' if held_out else 'training'} files under {root}")
  chunks = []
  for f in files:
    with open(os.path.join(root, f), "rb") as fh:
      chunks.append(fh.read() + b"\n\n")
  return np.frombuffer(b"".join(chunks), np.uint8), files


def held_out_prompts(lengths, root: str | None = None) -> list[list[int]]:
  """Byte prompts from held-out files (never trained on), one per entry of
  `lengths`: that many bytes from the file's first top-level `def` (its
  start if none), files in order, cycling when there are fewer files."""
  root = root or sysconfig.get_paths()["stdlib"]
  snippets = []
  for f in corpus_files(root):
    if not is_held_out(f):
      continue
    with open(os.path.join(root, f), "rb") as fh:
      data = fh.read()
    snippets.append(data[data.find(b"\ndef ") + 1:])  # find -1 -> the start
  longest = max(lengths)
  usable = [d for d in snippets if len(d) >= longest]
  if not usable:
    raise ValueError(f"no held-out file has {longest} bytes after its first def")
  return [list(usable[i % len(usable)][:n]) for i, n in enumerate(lengths)]


def _hidden(cfg: ModelConfig, params, tokens):
  """Full causal trunk: tokens [B, T] -> final-normed hidden [B, T, D]."""
  B, T = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  return trunk(cfg, params, tokens, FullContext(positions, cfg.window_choices()))[0]


def batches(data: np.ndarray, batch: int, seq_len: int, seed: int):
  """Endless random windows [batch, seq_len] int32 of the byte stream."""
  if len(data) <= seq_len:
    raise ValueError(f"corpus of {len(data)} bytes is shorter than seq_len {seq_len}")
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - seq_len, batch)
    yield np.stack([data[s:s + seq_len] for s in starts]).astype(np.int32)


def _ce(logits, targets, mask):
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  correct = (jnp.argmax(logits, axis=-1) == targets)
  n = jnp.maximum(jnp.sum(mask), 1)
  return jnp.sum(nll * mask) / n, jnp.sum(correct * mask) / n


def loss_fn(cfg: ModelConfig, params, tokens, *, depths: int, mtp_weight: float):
  """tokens [B, T] -> (loss, metrics). Position i predicts t_{i+1} (main)
  and t_{i+k+1} (MTP depth k); positions without a target are masked."""
  B, T = tokens.shape
  x = _hidden(cfg, params, tokens)
  main_logits = head(cfg, params, x[:, :-1])
  ones = jnp.ones((B, T - 1), jnp.float32)
  main_loss, main_acc = _ce(main_logits, tokens[:, 1:], ones)
  metrics = dict(loss_main=main_loss, acc_main=main_acc)
  loss = main_loss
  if depths:
    all_logits = mtp.train_logits(cfg, params, x, tokens, depths)  # [K, B, T, V]
    mtp_losses = []
    for k in range(1, depths + 1):
      targets = jnp.pad(tokens[:, k + 1:], ((0, 0), (0, k + 1)))
      mask = jnp.broadcast_to((jnp.arange(T) < T - k - 1).astype(jnp.float32), (B, T))
      l_k, a_k = _ce(all_logits[k - 1], targets, mask)
      metrics[f"loss_mtp{k}"], metrics[f"acc_mtp{k}"] = l_k, a_k
      mtp_losses.append(l_k)
    loss = loss + mtp_weight * sum(mtp_losses) / depths
  metrics["loss"] = loss
  return loss, metrics


def distill_loss_fn(cfg: ModelConfig, mtp_params, params, tokens, *, depths: int):
  """MTP self-distillation (the speculative step accepts a draft when the
  target agrees, not when the data does): depth k at position i learns the
  frozen target's next-token distribution at position i + k, soft CE.
  Gradients reach only `mtp_params`. -> (loss, metrics)."""
  B, T = tokens.shape
  x = jax.lax.stop_gradient(_hidden(cfg, params, tokens))
  target = jax.lax.stop_gradient(jax.nn.softmax(head(cfg, params, x), -1))  # [B, T, V]
  all_logits = mtp.train_logits(cfg, dict(params, mtp=mtp_params), x, tokens, depths)
  metrics, losses = {}, []
  for k in range(1, depths + 1):
    p = jnp.pad(target[:, k:], ((0, 0), (0, k), (0, 0)))
    mask = (jnp.arange(T) < T - k).astype(jnp.float32)[None]
    logq = jax.nn.log_softmax(all_logits[k - 1], -1)
    ce = -jnp.sum(p * logq, -1)
    n = jnp.sum(mask) * B
    losses.append(jnp.sum(ce * mask) / n)
    agree = jnp.argmax(all_logits[k - 1], -1) == jnp.argmax(p, -1)
    metrics[f"distill_ce{k}"] = losses[-1]
    metrics[f"agree_mtp{k}"] = jnp.sum(agree * mask) / n
  loss = sum(losses) / depths
  metrics["loss"] = loss
  return loss, metrics


@functools.partial(jax.jit, static_argnames=("cfg", "opt", "depths"),
                   donate_argnames=("mtp_params", "opt_state"))
def distill_step(cfg: ModelConfig, opt, mtp_params, params, opt_state, tokens, *, depths: int):
  (_, metrics), grads = jax.value_and_grad(
      lambda m: distill_loss_fn(cfg, m, params, tokens, depths=depths), has_aux=True)(mtp_params)
  updates, opt_state = opt.update(grads, opt_state, mtp_params)
  return optax.apply_updates(mtp_params, updates), opt_state, metrics


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float = 0.1,
                   clip: float = 1.0):
  warmup = min(warmup, max(steps // 10, 1))
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr * 0.05)
  return optax.chain(optax.clip_by_global_norm(clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay))


@functools.partial(jax.jit, static_argnames=("cfg", "opt", "depths", "mtp_weight"),
                   donate_argnames=("params", "opt_state"))
def train_step(cfg: ModelConfig, opt, params, opt_state, tokens, *, depths: int,
               mtp_weight: float):
  (_, metrics), grads = jax.value_and_grad(
      lambda p: loss_fn(cfg, p, tokens, depths=depths, mtp_weight=mtp_weight), has_aux=True)(params)
  updates, opt_state = opt.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, metrics


@functools.partial(jax.jit, static_argnames=("cfg", "depths"))
def eval_step(cfg: ModelConfig, params, tokens, *, depths: int):
  return loss_fn(cfg, params, tokens, depths=depths, mtp_weight=1.0)[1]


def evaluate(cfg: ModelConfig, params, data: np.ndarray, *, seq_len: int, batch: int,
             depths: int, max_windows: int | None = None) -> dict:
  """Mean metrics over consecutive non-overlapping windows of `data`;
  perplexity = exp(main CE) in nats per byte."""
  n = (len(data) - 1) // seq_len
  if max_windows:
    n = min(n, max_windows)
  n -= n % batch
  if n == 0:
    raise ValueError(f"held-out data ({len(data)} bytes) is shorter than one batch of windows")
  windows = data[:n * seq_len].reshape(n, seq_len).astype(np.int32)
  sums = {}
  for i in range(0, n, batch):
    m = eval_step(cfg, params, jnp.asarray(windows[i:i + batch]), depths=depths)
    for k, v in m.items():
      sums[k] = sums.get(k, 0.0) + float(v)
  out = {k: v / (n // batch) for k, v in sums.items()}
  out["perplexity"] = float(np.exp(out["loss_main"]))
  out["bits_per_byte"] = out["loss_main"] / float(np.log(2))
  return out
