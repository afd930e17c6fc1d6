"""A training run's timeline, for its plot artifact: throughput with the interruptions marked, standbys by tier.

The supervisor records a `Sample` whenever it reads the committed step (at most every `Timeline.every_s`), with the
warm and parked standby counts of that moment; `plot_timeline` draws the run from those samples and the
coordinator's `member_failed` events (each a red line, labelled with its rank and cause). matplotlib is imported
inside `plot_timeline` only.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from runtime.wire.event_records import Event, MemberFailed


@dataclass(frozen=True, slots=True)
class Sample:
    at: float
    """Epoch seconds."""
    step: int
    warm: int
    parked: int


@dataclass(slots=True)
class Timeline:
    every_s: float = 1.0
    samples: list[Sample] = field(default_factory=list)

    def record(self, at: float, step: int | None, warm: int, parked: int) -> None:
        """Keep a sample when `every_s` passed since the last one, or the standby counts changed."""
        if step is None:
            return
        last = self.samples[-1] if self.samples else None
        if last is None or at - last.at >= self.every_s or (warm, parked) != (last.warm, last.parked):
            self.samples.append(Sample(at, int(step), warm, parked))


def interruptions_of(events: Sequence[Event]) -> list[tuple[float, int, str]]:
    """(epoch seconds, rank, cause) of every worker failure or planned move in the coordinator's events."""
    return [(e.time, e.rank, e.cause) for e in events if isinstance(e, MemberFailed)]


def plot_timeline(samples: Sequence[Sample], interruptions: Sequence[tuple[float, int, str]], path: Path,
                  title: str) -> bool:
    """Draw the run into `path` (PNG): steps per second over time with each interruption marked, and the warm and
    parked standbys over time. False (and no file) when there are fewer than two samples to draw."""
    if len(samples) < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")  # no display on a worker host
    import matplotlib.pyplot as plt

    t0 = samples[0].at
    times = [s.at - t0 for s in samples]
    rates = [0.0] + [
        max(0.0, (b.step - a.step) / (b.at - a.at)) if b.at > a.at else 0.0 for a, b in itertools.pairwise(samples)
    ]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.plot(times, rates, color="tab:blue", linewidth=1.2, label="steps/s")
    top.set_ylabel("steps / s")
    top.set_title(title)
    for at, rank, cause in interruptions:
        x = at - t0
        top.axvline(x, color="tab:red", linestyle="--", linewidth=1)
        top.annotate(f"rank {rank}: {cause[:40]}", (x, top.get_ylim()[1]), rotation=90, va="top", ha="right",
                     fontsize=7, color="tab:red")
    bottom.step(times, [s.warm for s in samples], where="post", label="warm", color="tab:orange")
    bottom.step(times, [s.parked for s in samples], where="post", label="parked (stopped)", color="tab:gray")
    bottom.set_ylabel("standbys")
    bottom.set_xlabel("seconds since the job started")
    bottom.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown_image(png: Path, alt: str) -> str:
    """The PNG embedded in markdown (a data URI): the artifact outlives any file on the worker host."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})"


__all__ = ["Sample", "Timeline", "interruptions_of", "markdown_image", "plot_timeline"]
