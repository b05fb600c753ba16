"""UniPC multistep on flow-matching sigmas, as a table of per-step coefficients.

diffusers' `UniPCMultistepScheduler` with `use_flow_sigmas` and
`prediction_type="flow_prediction"` (Wan's scheduler_config.json: order 2,
bh2, predict_x0, lower_order_final, final sigma 0). With flow sigmas
alpha = 1 - sigma, lambda = log(alpha / sigma), and the model's velocity v
gives the data prediction m = x - sigma v. Every update of the solver is then
a fixed linear combination of the sample and the last data predictions
(UniPC, Zhao et al. 2023, eqs. 5-8 with B(h) = e^h - 1), whose weights depend
only on the sigmas: `schedule` computes them on the host once, and `step`
applies them on device, so the whole loop is one traced program.

Step i (sigma_i -> sigma_{i+1}), m_i the data prediction at step i:
  corrector (i > 0): x <- cx * last + c0 * m_{i-1} + c1 * m_{i-2} + ct * m_i
                      (i = 0: x unchanged; `self` weight 1, the others 0)
  predictor:         x_{i+1} = px * x + p0 * m_i + p1 * m_{i-1}
  last <- x (the corrected sample)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowUniPC:
  num_train_timesteps: int = 1000
  flow_shift: float = 3.0
  solver_order: int = 2

  def __post_init__(self):
    if self.solver_order not in (1, 2):
      raise ValueError(f"FlowUniPC.solver_order must be 1 or 2, got {self.solver_order}")
    if self.flow_shift <= 0 or self.num_train_timesteps < 2:
      raise ValueError(f"FlowUniPC: flow_shift ({self.flow_shift}) must be > 0 and "
                       f"num_train_timesteps ({self.num_train_timesteps}) >= 2")

  @classmethod
  def from_diffusers(cls, c: dict) -> "FlowUniPC":
    """A diffusers scheduler_config.json; ValueError for settings not reproduced."""
    want = dict(_class_name="UniPCMultistepScheduler", use_flow_sigmas=True,
                prediction_type="flow_prediction", predict_x0=True, solver_type="bh2",
                lower_order_final=True, final_sigmas_type="zero", timestep_spacing="linspace",
                thresholding=False, use_dynamic_shifting=False, use_karras_sigmas=False,
                use_exponential_sigmas=False, use_beta_sigmas=False, disable_corrector=[],
                solver_p=None, shift_terminal=None)
    for key, value in want.items():
      if c.get(key, value) != value:
        raise ValueError(f"FlowUniPC.from_diffusers: {key}={c[key]!r} is not supported "
                         f"(only {value!r})")
    return cls(num_train_timesteps=c.get("num_train_timesteps", 1000),
               flow_shift=c.get("flow_shift", 1.0), solver_order=c.get("solver_order", 2))


@dataclasses.dataclass(frozen=True)
class Schedule:
  """Per-step arrays over the N steps (float32, host numpy)."""
  timesteps: np.ndarray  # [N] int: the model's timestep (diffusers truncates sigma * 1000)
  sigmas: np.ndarray  # [N + 1], last 0
  corrector: np.ndarray  # [N, 5]: self, cx, c0, c1, ct
  predictor: np.ndarray  # [N, 3]: px, p0, p1


def sigmas(s: FlowUniPC, num_steps: int) -> np.ndarray:
  """[N + 1] float32: linspace(1, 1/T) shifted by flow_shift, then 0."""
  sig = np.linspace(1, 1 / s.num_train_timesteps, num_steps + 1)[:-1]
  sig = s.flow_shift * sig / (1 + (s.flow_shift - 1) * sig)
  if abs(sig[0] - 1) < 1e-6:
    sig[0] -= 1e-6
  return np.concatenate([sig, [0.0]]).astype(np.float32)


def _lam(sig):
  with np.errstate(divide="ignore"):
    return np.log(1.0 - sig) - np.log(sig)  # +inf at sigma 0


def _bh2(h: float, order: int, r1: float | None):
  """h_phi_1, B(h) and the rhos of UniP (rhos_p) and UniC (rhos_c) for step size h."""
  hh = -h
  h_phi_1 = np.expm1(hh)
  B_h = h_phi_1
  h_phi_k, fact, b = h_phi_1 / hh - 1, 1, []
  for i in range(1, order + 1):
    b.append(h_phi_k * fact / B_h)
    fact *= i + 1
    h_phi_k = h_phi_k / hh - 1 / fact
  if order == 1:
    rhos_c = np.array([0.5])
  else:
    rhos_c = np.linalg.solve(np.array([[1.0, 1.0], [r1, 1.0]]), np.array(b))
  return h_phi_1, B_h, rhos_c


def _predictor(sig, lam, i: int, order: int):
  a_t = 1.0 - sig[i + 1]
  h = lam[i + 1] - lam[i]
  h_phi_1, B_h, _ = _bh2(h, 1, None)
  px, p0, p1 = sig[i + 1] / sig[i], -a_t * h_phi_1, 0.0
  if order == 2:  # rhos_p = 0.5 on D1 = (m_{i-1} - m_i) / r1
    r1 = (lam[i - 1] - lam[i]) / h
    p0 += a_t * B_h * 0.5 / r1
    p1 = -a_t * B_h * 0.5 / r1
  return px, p0, p1


def _corrector(sig, lam, i: int, order: int):
  a_t = 1.0 - sig[i]
  h = lam[i] - lam[i - 1]
  r1 = (lam[i - 2] - lam[i - 1]) / h if order == 2 else None
  h_phi_1, B_h, rhos = _bh2(h, order, r1)
  ct = -a_t * B_h * rhos[-1]
  c0 = -a_t * h_phi_1 - ct
  c1 = 0.0
  if order == 2:  # rhos[0] on D1 = (m_{i-2} - m_{i-1}) / r1
    c0 += a_t * B_h * rhos[0] / r1
    c1 = -a_t * B_h * rhos[0] / r1
  return 0.0, sig[i] / sig[i - 1], c0, c1, ct


def schedule(s: FlowUniPC, num_steps: int) -> Schedule:
  """The solver's coefficient table for `num_steps` steps (module docstring)."""
  if num_steps < 1:
    raise ValueError(f"num_steps must be >= 1, got {num_steps}")
  sig32 = sigmas(s, num_steps)
  sig = sig32.astype(np.float64)
  lam = _lam(sig)
  orders = [min(s.solver_order, num_steps - i, i + 1) for i in range(num_steps)]
  pred = [_predictor(sig, lam, i, orders[i]) for i in range(num_steps)]
  corr = [(1.0, 0.0, 0.0, 0.0, 0.0)] + [_corrector(sig, lam, i, orders[i - 1])
                                        for i in range(1, num_steps)]
  timesteps = (sig[:-1] * s.num_train_timesteps).astype(np.int64)
  return Schedule(timesteps, sig32, np.asarray(corr, np.float32), np.asarray(pred, np.float32))


def init_state(x):
  """(x, last, m_prev, m_prev2): the sample and the solver's history."""
  z = jnp.zeros_like(x)
  return x, z, z, z


def step(state, v, sigma, corr, pred):
  """One UniPC step from the model's velocity v at the state's sample.
  corr [5], pred [3], sigma: this step's row of the `Schedule`."""
  x, last, m1, m2 = state
  m = x - sigma * v  # data prediction (flow: x0 = x - sigma * v)
  x = corr[0] * x + corr[1] * last + corr[2] * m1 + corr[3] * m2 + corr[4] * m
  x_next = pred[0] * x + pred[1] * m + pred[2] * m1
  return x_next, x, m, m1
