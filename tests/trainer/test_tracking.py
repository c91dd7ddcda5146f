"""Console progress when the console is not a terminal: plain lines, not one \\r-joined bar."""

from __future__ import annotations

from rlhf.trainer.tracking import PlainProgress


def test_plain_progress_prints_a_line_every_twentieth_of_the_run_or_30_s_and_at_the_end():
    now, lines = [0.0], []
    p = PlainProgress(100, write=lines.append, clock=lambda: now[0])
    for step in range(1, 101):
        now[0] += 1.0
        p.set_postfix({"reward/mean": f"{step / 100:.3g}"})
        p.update(1)
    assert len(lines) == 20 and lines[0] == "rlhf: step 5/100 (1.0 s/step) reward/mean=0.05"
    assert lines[-1].startswith("rlhf: step 100/100")
    # slow steps: a line every 30 s even between the twentieths; a resumed run counts from its start
    now, lines = [0.0], []
    p = PlainProgress(1000, initial=500, write=lines.append, clock=lambda: now[0])
    for _ in range(3):
        now[0] += 40.0
        p.update(1)
    assert lines == [f"rlhf: step {n}/1000 (40.0 s/step)" for n in (501, 502, 503)]


def test_fast_steps_show_milliseconds_not_zero_seconds():
    now, lines = [0.0], []
    p = PlainProgress(60, write=lines.append, clock=lambda: now[0])
    for _ in range(3):
        now[0] += 0.028
        p.update(1)
    assert lines == ["rlhf: step 3/60 (28 ms/step)"]


def test_a_terminal_without_a_size_gets_plain_lines(monkeypatch):
    """A pty a program opened (`script` without a terminal, some CI runners) has 0 columns:
    tqdm would print nothing there at all, so it gets the plain lines."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    from rlhf.trainer.tracking import _terminal_columns

    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as tty:
        monkeypatch.setattr("sys.stderr", tty)
        assert tty.isatty() and _terminal_columns() == 0
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        assert _terminal_columns() == 120
    os.close(master)
    monkeypatch.setattr("sys.stderr", open(os.devnull, "w"))  # noqa: SIM115 - closed with the process
    assert _terminal_columns() == 0
