"""Duration and length distributions of the simulator, sampled in vectorised blocks (pure NumPy, no jax).

Every distribution is parameterised by its **mean** (before clipping to `[lo, hi]`), so a sweep over the tail
weight (`sigma`, `alpha`) changes the shape and keeps the average work fixed:

  constant   x = mean
  lognormal  x = exp(mu + sigma * z), z ~ N(0, 1), mu = ln(mean) - sigma^2 / 2        (E[x] = mean)
  pareto     x = x_m * (1 + Lomax(alpha)) = x_m * U^(-1/alpha), x_m = mean * (alpha - 1) / alpha, alpha > 1
             (P[x > y] = (x_m / y)^alpha: the heavier the tail, the smaller alpha; E[x] = mean)
  cycle      x_k = values[k mod len(values)] for the k-th sample drawn: deterministic, for tests and replays

then `x <- clip(x, lo, hi)`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sao_jax.errors import ConfigError

KINDS = ('constant', 'lognormal', 'pareto', 'cycle')


@dataclasses.dataclass(frozen=True)
class Dist:
  """A non-negative distribution: `kind` in KINDS, `mean` (before clipping), shape `sigma` or `alpha`, `[lo, hi]`."""
  kind: str = 'constant'
  mean: float = 0.0
  sigma: float = 1.0  # lognormal: standard deviation of log(x).
  alpha: float = 2.0  # pareto: tail index (> 1 for a finite mean).
  lo: float = 0.0
  hi: float = math.inf
  values: tuple[float, ...] = ()  # cycle: the values, in order.

  def validate(self, name: str) -> None:
    """Raises ConfigError naming `name` if the parameters cannot work."""
    if self.kind not in KINDS:
      raise ConfigError(f'{name}.kind={self.kind!r}: must be one of {KINDS}')
    if self.kind == 'cycle':
      if not self.values or min(self.values) < 0:
        raise ConfigError(f'{name}.values={self.values!r}: cycle needs a non-empty tuple of values >= 0')
    elif not self.mean >= 0:
      raise ConfigError(f'{name}.mean={self.mean}: must be >= 0')
    if self.kind == 'lognormal' and not self.sigma >= 0:
      raise ConfigError(f'{name}.sigma={self.sigma}: must be >= 0')
    if self.kind == 'pareto' and not self.alpha > 1:
      raise ConfigError(f'{name}.alpha={self.alpha}: must be > 1 (a finite mean)')
    if not 0 <= self.lo <= self.hi:
      raise ConfigError(f'{name}: lo={self.lo}, hi={self.hi}: need 0 <= lo <= hi')

  def sample(self, rng: np.random.Generator, n: int, offset: int = 0) -> np.ndarray:
    """`n` float64 samples; `offset` is how many samples were drawn before (used by `cycle` only)."""
    if self.kind == 'constant':
      x = np.full(n, float(self.mean))
    elif self.kind == 'lognormal':
      mu = math.log(self.mean) - 0.5 * self.sigma ** 2 if self.mean > 0 else -math.inf
      x = np.exp(mu + self.sigma * rng.standard_normal(n))
    elif self.kind == 'pareto':
      x_m = self.mean * (self.alpha - 1) / self.alpha
      x = x_m * (1.0 + rng.pareto(self.alpha, n))
    else:
      v = np.asarray(self.values, np.float64)
      x = v[(offset + np.arange(n)) % v.size]
    if self.lo > 0 or self.hi < math.inf:
      x = np.clip(x, self.lo, self.hi)
    return x

  def to_dict(self) -> dict[str, Any]:
    """The fields that matter for this kind (JSON-friendly; `math.inf` is written as the string 'inf')."""
    d: dict[str, Any] = {'kind': self.kind}
    if self.kind == 'cycle':
      d['values'] = list(self.values)
    else:
      d['mean'] = self.mean
    if self.kind == 'lognormal':
      d['sigma'] = self.sigma
    if self.kind == 'pareto':
      d['alpha'] = self.alpha
    if self.lo > 0:
      d['lo'] = self.lo
    if self.hi < math.inf:
      d['hi'] = self.hi
    return d

  @classmethod
  def of(cls, spec: Any) -> Dist:
    """A Dist from a number (constant), a Dist, or a mapping: the fields, or `{"samples": [...], "kind": ...}`

    (fitted by `Dist.fit`, for measured samples).
    """
    if isinstance(spec, Dist):
      return spec
    if isinstance(spec, (int, float)):
      return cls('constant', float(spec))
    if isinstance(spec, Mapping):
      spec = dict(spec)
      if 'samples' in spec:
        return cls.fit(spec['samples'], spec.get('kind', 'lognormal'))
      if 'values' in spec:
        spec['values'] = tuple(float(v) for v in spec['values'])
      for k in ('lo', 'hi', 'mean', 'sigma', 'alpha'):
        if k in spec:
          spec[k] = float(spec[k])
      return cls(**spec)
    raise ConfigError(f'cannot read a distribution from {spec!r}')

  @classmethod
  def fit(cls, samples: Sequence[float], kind: str = 'lognormal') -> Dist:
    """Moment fit to measured samples: the sample mean, and the shape from the samples.

    lognormal: sigma = std(log x) (x > 0); pareto: alpha from the mean/minimum ratio, E[x]/x_min = alpha/(alpha-1)
    -> alpha = r / (r - 1), r = mean / min; constant: the mean.
    """
    x = np.asarray(samples, np.float64)
    if x.size == 0 or np.any(x < 0):
      raise ConfigError(f'Dist.fit: need non-empty non-negative samples, got {x.size} values')
    mean = float(x.mean())
    if kind == 'constant':
      return cls('constant', mean)
    if kind == 'lognormal':
      pos = x[x > 0]
      return cls('lognormal', mean, sigma=float(np.log(pos).std()) if pos.size > 1 else 0.0)
    if kind == 'pareto':
      r = mean / float(x.min()) if x.min() > 0 else math.inf
      return cls('pareto', mean, alpha=r / (r - 1) if r > 1 else 1e6)
    raise ConfigError(f'Dist.fit: kind={kind!r} must be constant, lognormal or pareto')
