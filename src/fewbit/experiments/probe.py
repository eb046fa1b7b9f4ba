"""What one weight update did, measured: the diagnostics of a training run's write-back.

A :class:`StepProbe` hangs on the inner optimizer's step hooks (torch's public
``register_step_pre_hook`` / ``register_step_post_hook``). Armed before a step, it keeps
each weight before the step and right after the inner optimizer's update (``w + u`` in
float32, before ``LowPrecisionWeights`` rounds it back), and once the step is over
:meth:`StepProbe.read` gives, per weight matrix and over all of them:

- ``mean_abs``: the mean magnitude of the weights after the step;
- ``changed``: the fraction of weights whose value the step changed;
- ``outward_ulp``: the mean error of the write-back, ``|rounded| - |w + u|`` in ulps of
  the weight format (``fewbit.bias.outward_error``): positive where rounding moved
  magnitudes away from zero. It is measured against the float32 ``w + u``, so it holds
  the whole write-back: the update dtype's rounding and the format's.

Unarmed, the hooks do nothing, so a run pays for the copies only at the steps it probes.
"""

from __future__ import annotations

import torch

from ..bias import outward_error
from ..formats import FloatFormat


class StepProbe:
    """Measure the steps of ``optimizer`` on ``named`` weights (name, parameter) that
    :meth:`arm` selects; ``fmt`` is the format the weights are written back to, or None
    (kept as they are: no write-back error)."""

    def __init__(self, optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]],
                 fmt: FloatFormat | str | None):  # fmt: skip
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.fmt = fmt
        self._armed = False
        self._before: list[torch.Tensor] = []
        self._exact: list[torch.Tensor] = []
        optimizer.register_step_pre_hook(lambda *_: self._keep(self._before))
        optimizer.register_step_post_hook(lambda *_: self._keep(self._exact))

    def arm(self) -> None:
        """Measure the next step."""
        self._armed = True

    def _keep(self, into: list[torch.Tensor]) -> None:
        if self._armed:
            into[:] = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def read(self) -> list[dict]:
        """The armed step's diagnostics, one dict per weight and a last one (``"all"``)
        over every element; disarms the probe."""
        if not (self._armed and self._exact):
            raise RuntimeError("StepProbe.read() needs a step taken after arm()")
        rows = []
        for name, p, before, exact in zip(self.names, self.params, self._before, self._exact, strict=True):
            w = p.detach()
            error = None if self.fmt is None else outward_error(exact, w, self.fmt).mean().item()
            rows.append(_row(name, w, changed=(w != before).double().mean().item(), outward_ulp=error))
        self._armed, self._before, self._exact = False, [], []
        return _with_total(rows)


def mean_abs(named: list[tuple[str, torch.Tensor]]) -> list[dict]:
    """Rows like :meth:`StepProbe.read`'s with the weights' mean magnitude alone (before
    any step)."""
    return _with_total([_row(n, p.detach()) for n, p in named])


_MEASURES = ("mean_abs", "changed", "outward_ulp")


def _row(name: str, w: torch.Tensor, changed: float | None = None, outward_ulp: float | None = None) -> dict:
    return {"param": name, "numel": w.numel(), "mean_abs": w.abs().double().mean().item(),
            "changed": changed, "outward_ulp": outward_ulp}  # fmt: skip


def _with_total(rows: list[dict]) -> list[dict]:
    """``rows`` and their element-weighted mean, ``param`` ``"all"``."""
    numel = sum(r["numel"] for r in rows)
    total = {"param": "all", "numel": numel}
    for k in _MEASURES:
        known = all(r[k] is not None for r in rows)
        total[k] = sum(r[k] * r["numel"] for r in rows) / numel if known else None
    return [*rows, total]
