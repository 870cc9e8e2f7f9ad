"""Decision margins of a decoding run: how far each ranking or threshold decision was from flipping.

A reference fixture is only a reference if every decision along its trajectory clears the
numerical spread between CPUs (float32 forwards differ in their last bits between ATen's AVX-512,
AVX2 and scalar kernels). `DecisionMargins` watches the torch calls a decoder makes while it is
active and records, for each decision, its margin:

- a ranking (`argmax`/`argmin`, `max`/`min` over a dim, `topk`): the best minus the second best
  (for `topk(k)`, the k-th minus the next value below it: only the boundary of the chosen set
  decides; exact ties are passed over, see `ranking_margin`);
- a threshold (`>`, `>=`, `<`, `<=` with a float operand): the distance between the two sides,
  over the elements where both are finite and not exactly equal (an element equal to its own
  bound is a rule comparing a value with itself, e.g. "above the k-th");

in the dtype the rule compares in, relative to the magnitude of what is compared (a ranking's
largest value in its slice, a threshold's larger side): the spread between CPUs is a few units in
the last place of logits, so a relative margin is comparable across logits and the probabilities of
flat (1e-5) and peaked distributions. Where both compared values are probabilities (in [0, 1]) the
gap is measured against the nearer end instead, `min(magnitude, 1 - lower)` (`_saturated_scale`):
a lower bound on their log-odds gap, so confidences saturated near 1 (1 - 1e-8 against 1 - 5e-9 in
float64) count by how far apart their distances from 1 are, which is what a last-bit change of the
logits moves. The distance from 1 is floored at `SATURATION_ULPS` units of the dtype's eps per unit
of margin, so a float32 probability near 1 (whose own rounding is absolute, ~6e-8) gains nothing
from it: only a gap many of its own ulps wide clears a bound. Non-finite values and sentinels past
`SENTINEL` (masked-out positions at -inf or finfo.min) never count.

It works on any code, the official reference implementations included (it sees torch calls, not
remask's functions), so a fixture generator wraps its reference call in it:

    with DecisionMargins() as margins:
        out = reference_generate(model, prompt, ...)
    case["min_margin"] = margins.minimum()

Calls whose result is numerics rather than a decision (a softmax's stabilising max, a `> 0` guard)
are told apart by call site: `by_site()` lists each site's smallest margin, and `ignore=` names
sites (substrings of "path:function") that are not decisions. docs/reference-fixtures.md has the
rule and the bound fixtures must clear.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any, Iterable

import torch
from torch.overrides import TorchFunctionMode

_RANK = {"argmax": 1, "argmin": -1, "max": 1, "min": -1}
_COMPARE = {"gt", "ge", "lt", "le", "__gt__", "__ge__", "__lt__", "__le__", "greater", "greater_equal", "less",
            "less_equal"}
_TORCH_DIR = os.path.dirname(torch.__file__)
CASE = "#case"   # the site of a `mark`: what follows belongs to that case
_HERE = os.path.abspath(__file__)
_ROOT = os.path.dirname(os.path.dirname(_HERE))   # the checkout (remask/ is one level down)


SENTINEL = 1e30   # |x| past this is a stand-in for ±inf (finfo.min floors), not a score


def _real(x: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(x) & (x.abs() < SENTINEL)


# A margin at the least bound fixtures use (1e-5) measured against a distance from 1 must still be
# this many units of the dtype's eps wide: the distance from 1 counts down to SATURATION_ULPS * eps / 1e-5
# (float64: 2.2e-10; float32: 0.12, so a float32 probability's own rounding near 1 is never read as margin).
SATURATION_ULPS = 10.0
_LEAST_MARGIN = 1e-5


def _saturated_scale(high: torch.Tensor, low: torch.Tensor, scale: torch.Tensor,
                     probabilities: torch.Tensor) -> torch.Tensor:
    """The scale a gap between probabilities is measured against: `min(scale, 1 - low)`, the distance
    from 1 floored per dtype (SATURATION_ULPS), where `probabilities` (what is compared lies in
    [0, 1]); `scale` elsewhere.

    For 0 < low < high < 1, logit(high) - logit(low) = log(high/low) + log((1-low)/(1-high))
    >= (high-low) / min(high, 1-low): with `scale` >= high this margin never exceeds the log-odds gap,
    and below saturation (1 - low >= scale) it is the relative margin unchanged."""
    floor = SATURATION_ULPS * torch.finfo(low.dtype).eps / _LEAST_MARGIN
    distance = (1 - low).clamp_min(floor)
    return torch.where(probabilities, torch.minimum(scale, distance), scale)


def _scaled_gap(high: torch.Tensor, low: torch.Tensor, scale: torch.Tensor, probabilities: torch.Tensor) -> float:
    """min over elements of (high - low) / scale, over real pairs; inf if none (`scale` narrowed to
    the distance from 1 where `probabilities`: `_saturated_scale`)."""
    high, low, scale, probabilities = torch.broadcast_tensors(high, low, scale, probabilities)
    real = _real(high) & _real(low)
    if not bool(real.any()):
        return math.inf
    high, low, scale, probabilities = high[real], low[real], scale[real], probabilities[real]
    tiny = torch.finfo(high.dtype).tiny
    return float(((high - low) / _saturated_scale(high, low, scale, probabilities).clamp_min(tiny)).min())


def ranking_margin(values: torch.Tensor, dim: int, k: int, largest: bool = True) -> float:
    """The gap between the k-th best along `dim` and the best value strictly below it, relative to
    the slice's largest magnitude (inf where a slice has no such value). Values exactly equal to
    the k-th are passed over: their order is the index order, the same on every CPU as long as they
    stay equal, which values that are copies of one number (pooling, repeated scores) do everywhere."""
    if values.numel() == 0 or values.dim() == 0 or values.shape[dim] <= k:
        return math.inf
    n = values.shape[dim]
    v = values.movedim(dim, -1).reshape(-1, n)
    v = v if largest else -v
    real = _real(v)
    v = torch.where(real, v, torch.full_like(v, -math.inf))
    smallest = torch.where(real, v, torch.full_like(v, math.inf)).amin(dim=1)
    scale = torch.maximum(v.amax(dim=1).abs(), smallest.abs())
    scale = torch.where(torch.isfinite(scale), scale, torch.zeros_like(scale))
    # the k-th and what follows it, from a short top-k (a full sort of a 126k vocabulary is slow);
    # rows whose window holds only ties of the k-th look further, down the whole sorted row
    window = min(n, k + 8)
    ordered = torch.topk(v, window, dim=1).values
    kth = ordered[:, k - 1:k]
    below = torch.where(ordered < kth, ordered, torch.full_like(ordered, -math.inf)).amax(dim=1)
    open_rows = (below == -math.inf) & torch.isfinite(kth[:, 0])
    if window < n and bool(open_rows.any()):
        rest = torch.sort(v[open_rows], dim=1, descending=True).values
        below[open_rows] = torch.where(rest < kth[open_rows], rest, torch.full_like(rest, -math.inf)).amax(dim=1)
    # a slice of probabilities (every real value in [0, 1]) is measured in log-odds (`_saturated_scale`);
    # for a ranking from below the pair is turned back to the values' own sign first
    probabilities = (smallest >= 0) & (v.amax(dim=1) <= 1) if largest else (v.amax(dim=1) <= 0) & (smallest >= -1)
    high, low = (kth[:, 0], below) if largest else (-below, -kth[:, 0])
    return _scaled_gap(high, low, scale, probabilities)


def threshold_margin(a: torch.Tensor, b: Any) -> float:
    """The smallest |a - b| relative to max(|a|, |b|), over real, unequal elements."""
    b = torch.as_tensor(b, dtype=a.dtype if not isinstance(b, torch.Tensor) else None, device=a.device)
    a, b = torch.broadcast_tensors(a, b)
    differ = a != b
    if not bool(differ.any()):
        return math.inf
    a, b = a[differ], b[differ]
    high, low = torch.maximum(a, b), torch.minimum(a, b)
    return _scaled_gap(high, low, torch.maximum(a.abs(), b.abs()), (low >= 0) & (high <= 1))


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


class DecisionMargins(TorchFunctionMode):
    """Records the margin of every ranking and threshold decision made while active (see the
    module docstring). `minimum()` is the smallest over the sites not ignored; `decisions` keeps
    (site, margin) in call order, so two runs of one case can be compared decision by decision."""

    _active: list["DecisionMargins"] = []

    def __init__(self, ignore: Iterable[str] = ()):
        super().__init__()
        self.ignore = tuple(ignore)
        self.decisions: list[tuple[str, float]] = []

    def __enter__(self):
        DecisionMargins._active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        DecisionMargins._active.remove(self)
        return super().__exit__(*exc)

    @classmethod
    def mark(cls, label: str) -> None:
        """Start a new case in the active recorder's log (`decisions` gets `(CASE, label)`), so
        one run over several cases can be split per case; nothing when none is active."""
        for recorder in cls._active:
            recorder.decisions.append((CASE, label))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        try:
            margin = self._margin(name, args, kwargs)
        except Exception:  # a call shape this recorder does not read is not a decision it can rate
            margin = None
        if margin is not None:
            site = self._site(name)
            if not any(pattern in site for pattern in self.ignore):
                self.decisions.append((site, margin))
        return out

    @staticmethod
    def _margin(name: str, args: tuple, kwargs: dict) -> float | None:
        if name in _RANK:
            x = args[0] if args else kwargs.get("input")
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            # max/min with a second tensor is elementwise, without dim a plain reduction: no decision
            if not _is_float(x) or dim is None or isinstance(dim, torch.Tensor):
                return None
            return ranking_margin(x, dim, 1, largest=_RANK[name] > 0)
        if name == "topk":
            x = args[0] if args else kwargs.get("input")
            k = args[1] if len(args) > 1 else kwargs["k"]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
            if not _is_float(x):
                return None
            return ranking_margin(x, dim, int(k), largest=bool(largest))
        if name in _COMPARE:
            a = args[0] if args else kwargs.get("input")
            b = args[1] if len(args) > 1 else kwargs.get("other")
            if not (_is_float(a) or _is_float(b)):
                return None
            if isinstance(a, (int, float)) or isinstance(b, (int, float)):
                scalar = b if isinstance(b, (int, float)) else a
                if isinstance(scalar, bool) or not math.isfinite(scalar):
                    return None
            if not _is_float(a):
                a, b = b, a
            return threshold_margin(a, b)
        return None

    @staticmethod
    def _site(name: str) -> str:
        """path:function:op of the first caller outside torch and this module."""
        frame = sys._getframe(2)
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if not path.startswith(_TORCH_DIR) and path != _HERE:
                return f"{_short(path)}:{frame.f_code.co_name}:{name}"
            frame = frame.f_back
        return f"?:{name}"

    def minimum(self) -> float:
        return min((m for site, m in self.decisions if site != CASE), default=math.inf)

    def by_site(self) -> dict[str, float]:
        sites: dict[str, float] = {}
        for site, margin in self.decisions:
            if site != CASE:
                sites[site] = min(margin, sites.get(site, math.inf))
        return sites


def _short(path: str) -> str:
    """A site's path relative to the checkout or to site-packages, so sites read the same on every machine."""
    if path.startswith(_ROOT + os.sep):
        return os.path.relpath(path, _ROOT).replace(os.sep, "/")
    parts = path.replace(os.sep, "/").split("/")
    if "site-packages" in parts:
        return "/".join(parts[parts.index("site-packages") + 1:])
    return "/".join(parts[-2:])
