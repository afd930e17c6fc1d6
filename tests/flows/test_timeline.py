"""The run's timeline plot: samples kept at a bounded pace, interruptions read from the coordinator's events."""

from __future__ import annotations

from pathlib import Path

from flows.timeline import Timeline, interruptions_of, markdown_image, plot_timeline
from runtime.wire.event_records import GenerationStarted, MemberFailed, StandbySpawned


def test_samples_are_kept_every_interval_or_when_the_standbys_change() -> None:
    t = Timeline(every_s=1.0)
    t.record(100.0, 0, 1, 0)
    t.record(100.5, 5, 1, 0)  # too soon, nothing changed: dropped
    t.record(100.6, 6, 0, 1)  # a standby was promoted and one parked: kept
    t.record(100.7, None, 0, 1)  # no committed step known: dropped
    t.record(101.7, 20, 0, 1)
    assert [(s.at, s.step, s.warm, s.parked) for s in t.samples] == [
        (100.0, 0, 1, 0), (100.6, 6, 0, 1), (101.7, 20, 0, 1)]


def test_the_plot_marks_each_failure_and_embeds_as_a_data_uri(tmp_path: Path) -> None:
    t = Timeline(every_s=0.0)
    for i in range(30):
        t.record(1000.0 + i, 3 * i if i < 10 else 30 + 3 * (i - 12), 1 if i < 11 else 0, 0)
    events = [GenerationStarted(time=999.0, generation=0, reason="", world_size=2, members=[]),
              MemberFailed(time=1010.2, generation=0, rank=1, proc="w1", pid=7, cause="killed by SIGKILL", step=9,
                           failure_at=1010.1, declared_at=1010.2, detect_s=0.1),
              StandbySpawned(time=1011.0, proc="s1", reason="replace a promoted standby")]
    assert interruptions_of(events) == [(1010.2, 1, "killed by SIGKILL")]
    png = tmp_path / "timeline.png"
    assert plot_timeline(t.samples, interruptions_of(events), png, "job")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert markdown_image(png, "run").startswith("![run](data:image/png;base64,iVBORw0KGgo")
    assert not plot_timeline(t.samples[:1], [], tmp_path / "none.png", "job") and not (tmp_path / "none.png").exists()
