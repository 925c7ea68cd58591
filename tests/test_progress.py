"""Progress for people watching: a bar in place on a terminal, a plain line now and then elsewhere."""

from __future__ import annotations

import io

from support.clock import Clock

from draftfeed.progress import Progress


def test_not_a_terminal_prints_a_line_every_interval_and_at_the_end():
    clock, out = Clock(100.0), io.StringIO()
    progress = Progress(10, "steps", stream=out, every_s=5.0, clock=clock, terminal=False)
    for _ in range(4):
        clock.now += 1.0
        progress.advance()
    assert out.getvalue() == ""  # 4 s: no line yet
    clock.now += 1.0
    progress.advance(note="loss 1.5")
    assert out.getvalue() == "steps: 5/10 (50%), 1.00/s, ETA 5 s  loss 1.5\n"
    for _ in range(5):
        clock.now += 0.5
        progress.advance()
    assert out.getvalue().splitlines()[-1] == "steps: 10/10 (100%), 1.33/s, done"  # 10 steps in 7.5 s
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_terminal_redraws_in_place_and_lines_go_above_the_bar():
    clock, bar, lines = Clock(100.0), io.StringIO(), io.StringIO()
    progress = Progress(4, "scenarios", stream=bar, clock=clock, terminal=True)
    clock.now += 30.0
    progress.advance()
    assert bar.getvalue() == "\r\x1b[K[######------------------] scenarios: 1/4 (25%), 0.03/s, ETA 1 min 30 s"
    progress.write("running codec ...", stream=lines)
    assert lines.getvalue() == "running codec ...\n"
    assert bar.getvalue().endswith("\r\x1b[K\r\x1b[K[######------------------] scenarios: 1/4 (25%), 0.03/s, ETA 1 min 30 s")
    progress.close()
    assert bar.getvalue().endswith("\n")
