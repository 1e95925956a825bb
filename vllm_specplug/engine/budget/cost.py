"""Step time as a function of the rows the target verifies, learned online.

Model: knots over the number of verified rows (geometric, about four per
doubling), each an exponential moving average of the decode steps measured
there. Between measured knots the curve is interpolated. Where nothing was
measured it is extrapolated so that the controller tries sizes it does not
know yet and learns their cost, instead of never leaving the sizes it has
seen:

- above the largest measured knot, along the measured knots' average slope
  (flat while only one knot is known);
- below the smallest, optimistically (proportional to the rows);
- the curve never falls as rows grow: a knot much dearer than a larger one
  is a one-off and is left out of the curve; knots that differ by less
  (the noise of a flat stretch) are pooled to their mean.
"""

from __future__ import annotations

import bisect

import numpy as np


def pool_violators(ys: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence closest to ``ys`` in least squares: each
    run of values that falls is replaced by its mean (pool adjacent
    violators)."""
    sums: list[float] = []
    counts: list[int] = []
    for y in ys:
        sums.append(float(y))
        counts.append(1)
        while len(sums) > 1 and sums[-2] * counts[-1] > sums[-1] * counts[-2]:
            s, c = sums.pop(), counts.pop()
            sums[-1] += s
            counts[-1] += c
    return np.repeat([s / c for s, c in zip(sums, counts)], counts)


class StepCost:
    """Step time (seconds) vs rows verified in the step, learned online.

    The controller only visits the sizes it believes pay, so a knot measured
    too dear is not measured again soon: one stalled step (a new shape's
    first kernels, another process on the CPU) would keep every draft of
    that size and around it out for ``stale_after`` steps, and at batch 1
    the gate would close on it. So a knot enters the curve only from its
    second step, which the curve's optimistic reading there brings about,
    at the cheaper of its two steps (one-time costs only ever add time);
    after that a step counts at most ``max_rise`` times the knot's value
    (a lasting change still shows within a few steps). A knot not observed
    for ``stale_after`` steps leaves the curve (optimistic there) and starts
    over."""

    def __init__(self, max_rows: int = 1 << 16, ratio: float = 2 ** 0.25,
                 alpha: float = 0.2, stale_after: int = 256, max_rise: float = 2.0,
                 one_off: float = 1.25) -> None:
        knots, r = [1], 1.0
        while knots[-1] < max_rows:
            r *= ratio
            if round(r) > knots[-1]:
                knots.append(int(round(r)))
        self.knots = knots
        self.alpha = alpha
        self.stale_after = stale_after
        self.max_rise = max_rise
        self.one_off = one_off
        """A knot dearer than a larger one by more than this factor leaves
        the curve (``_refresh``); closer knots are pooled."""
        self.value = np.zeros(len(knots))
        self.count = np.zeros(len(knots), dtype=np.int64)
        self.last = np.zeros(len(knots), dtype=np.int64)  # clock when observed
        self.clock = 0  # steps observed
        self._refresh()

    def _curve(self) -> None:
        """The curve as last observed: derived again on the first read after
        an observed step (``_refresh``) -- not on the step itself, since a
        step the gate kept from drafting reads none of it."""
        if self._stale:
            self._refresh()

    def _refresh(self) -> None:
        # The curve only changes when a step is observed, while the
        # controller reads it once per candidate node: keep the fresh knots'
        # points instead of selecting them on every read.
        self._stale = False
        self._fresh = np.flatnonzero((self.count > 1)
                                     & (self.clock - self.last <= self.stale_after))
        # Verifying more rows never makes a step cheaper, so a knot much
        # dearer than a larger one (``one_off``) is a one-off (a stall, a
        # new shape, a warm-up beside another process) that its size's rare
        # visits do not correct. Kept, it makes plain decoding look dearer
        # than it is and the controller drafts trees that run slower than
        # plain decoding, so it leaves the curve, which is read there from
        # its consistent neighbours. It is not read at the larger knot's
        # value instead: plain decoding would then look as dear as the
        # larger drafted steps, their extra rows free, and the controller
        # would never stop drafting to measure the dear knot again.
        #
        # Knots closer than that are noise, not one-offs: where a step's
        # time hardly grows with its rows (a CPU at batch 1, 1 to 6 rows
        # within a few per cent) their order is chance. Dropping the plain
        # knot whenever a drafted size read a little cheaper left plain
        # decoding read proportionally below the smallest kept knot (at 6
        # rows, a sixth of its cost): no cut beat that, and the gate closed
        # on drafts that paid. Such knots are pooled to their mean (pool
        # adjacent violators): the non-decreasing curve nearest to them.
        ys = self.value[self._fresh]
        ok = ys <= self.one_off * np.minimum.accumulate(ys[::-1])[::-1]
        self._seen = self._fresh[ok]
        self._xs = np.asarray(self.knots, dtype=float)[self._seen]
        self._ys = pool_violators(ys[ok])

    def _knot(self, rows: int) -> int:
        i = bisect.bisect_left(self.knots, rows)
        if i == len(self.knots):
            return i - 1
        if i > 0 and rows - self.knots[i - 1] < self.knots[i] - rows:
            return i - 1
        return i

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or not seconds > 0:
            return
        k = self._knot(rows)
        self.clock += 1
        if self.count[k] == 0 or self.clock - self.last[k] > self.stale_after:
            self.value[k], self.count[k] = seconds, 0  # provisional
        elif self.count[k] == 1:
            self.value[k] = min(self.value[k], seconds)
        else:
            seconds = min(seconds, self.max_rise * self.value[k])
            self.value[k] += self.alpha * (seconds - self.value[k])
        self.count[k] += 1
        self.last[k] = self.clock
        self._stale = True

    @property
    def known(self) -> bool:
        """Some knot is on the curve (its second step was measured)."""
        self._curve()
        return bool(self._xs.size)

    def measured_up_to(self, rows: int) -> bool:
        """Some knot at or below ``rows``'s own knot (where its steps are
        counted) was measured (twice, lately), so ``self(rows)`` is not the
        optimistic extrapolation below every measured knot, which makes
        plain decoding look many times cheaper than it is. (A measured knot
        the curve leaves out as a one-off counts: it was measured.)"""
        self._curve()
        return bool(self._fresh.size) and int(self._fresh[0]) <= self._knot(rows)

    def knot_of(self, rows: int) -> int:
        """The knot (index) whose steps ``rows`` are counted with."""
        return self._knot(rows)

    def __call__(self, rows: int) -> float:
        """Estimated step time at ``rows``; 0 when nothing was measured yet."""
        self._curve()
        xs, ys = self._xs, self._ys
        if xs.size == 0:
            return 0.0
        if rows >= xs[-1]:
            # Along the measured curve's average slope (flat with one point),
            # not flat at the largest known value: an engine that knows only
            # small sizes would then take trees of many times those rows as
            # no dearer than the small ones.
            slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0]) if xs.size > 1 else 0.0
            return float(ys[-1] + slope * (rows - xs[-1]))
        if rows <= xs[0]:
            # optimistic: proportional (never 0: callers divide by it)
            return float(ys[0] * max(rows, 1) / xs[0])
        return float(np.interp(rows, xs, ys))

    def as_dict(self) -> dict:
        """The knots measured at least twice (ms), those left out of the
        curve included."""
        self._curve()
        return {str(self.knots[i]): round(1e3 * float(self.value[i]), 3) for i in self._fresh}

