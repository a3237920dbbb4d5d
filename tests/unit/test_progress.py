"""Progress bars (deepspeed/utils/progress.py): drawn on a terminal for the long jobs, never
otherwise, and never changing what the job produces.

The checkpoint used is one of the upstream fixtures (two ranks' files, written by upstream
DeepSpeed itself), so no process group is needed.
"""

from __future__ import annotations

import io
import os
import sys

import pytest
import torch

from deepspeed.checkpoint import zero_to_fp32
from deepspeed.checkpoint.sharded import ShardedCheckpoint
from deepspeed.utils import progress

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECKPOINT = os.path.join(REPO, "tests", "fixtures", "upstream", "fp32_ws2")
TAG = "global_step3"


class Terminal(io.StringIO):
    """A stderr that says it is a terminal, and keeps what was written to it."""

    def isatty(self) -> bool:
        return True


def on_terminal(monkeypatch) -> Terminal:
    """Called in the test body: pytest re-installs its own capture of sys.stderr between a
    fixture's set-up and the test, so a fixture could not swap it."""
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.delenv(progress.DISABLE_ENV, raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    return screen


def test_bars_only_on_a_terminal_and_when_not_switched_off(monkeypatch):
    on_terminal(monkeypatch)
    assert progress.bars_enabled()
    assert not progress.bars_enabled(quiet=True)
    monkeypatch.setenv(progress.DISABLE_ENV, "1")
    assert not progress.bars_enabled()
    monkeypatch.setenv(progress.DISABLE_ENV, "0")
    assert progress.bars_enabled()
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert not progress.bars_enabled()
    monkeypatch.delenv("TQDM_DISABLE")
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file, a pipe: no terminal
    assert not progress.bars_enabled()


def test_a_bad_switch_value_is_named(monkeypatch):
    on_terminal(monkeypatch)
    monkeypatch.setenv(progress.DISABLE_ENV, "yes")
    with pytest.raises(ValueError, match=r"DEEPSPEED_DISABLE_TQDM='yes' is neither 0 nor 1"):
        progress.bars_enabled()


def test_without_a_bar_the_items_come_back_untouched(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    items = [1, 2, 3]
    assert progress.progress(items, "x") is items
    with progress.progress_bar(3, "x") as bar:
        bar.update(2)
        bar.set_postfix_str("y")


def test_zero_to_fp32_draws_its_bars_on_a_terminal(tmp_path, monkeypatch):
    terminal = on_terminal(monkeypatch)
    expected = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(CHECKPOINT, quiet=True)
    assert terminal.getvalue() == ""
    out = tmp_path / "model"
    assert zero_to_fp32.main([CHECKPOINT, str(out), "--max_shard_size", "64B"]) == 0
    screen = terminal.getvalue()
    files = len(os.listdir(os.path.join(CHECKPOINT, TAG)))
    assert "Reading checkpoint files: 100%" in screen and f"{files}/{files}" in screen, screen
    params = len(ShardedCheckpoint.open(os.path.join(CHECKPOINT, TAG)).params)
    assert "Consolidating parameters: 100%" in screen and f"{params}/{params}" in screen, screen
    shards = [name for name in os.listdir(out) if name.startswith("pytorch_model-")]
    assert len(shards) > 1 and "Writing shards: 100%" in screen, (shards, screen)
    assert f"{len(shards)}/{len(shards)}" in screen, screen
    written: dict = {}
    for name in shards:
        written.update(torch.load(out / name, weights_only=True))
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name


def test_quiet_and_the_switch_silence_zero_to_fp32(tmp_path, monkeypatch):
    terminal = on_terminal(monkeypatch)
    assert zero_to_fp32.main([CHECKPOINT, str(tmp_path / "a"), "--quiet"]) == 0
    assert terminal.getvalue() == ""
    monkeypatch.setenv(progress.DISABLE_ENV, "1")
    assert zero_to_fp32.main([CHECKPOINT, str(tmp_path / "b")]) == 0
    assert terminal.getvalue() == ""
