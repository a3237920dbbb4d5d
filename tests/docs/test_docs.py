"""Every runnable block of README.md and docs/*.md runs (through Sybil, in `run_doc.py`).

Each page runs in its own process; the pages in TWO_RANK_PAGES, whose blocks are about what
ranks see, run under the `deepspeed` launcher at 2 processes. A block the page marks
`<!-- skip: next "reason" -->` is reported as skipped with that reason; every other block
must pass, and a page with no block that runs fails (so a broken parse cannot pass).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.common import get_free_port
from tests.unit.test_launcher import clean_env, launcher_cmd

ROOT = Path(__file__).resolve().parents[2]
RUNNER = str(Path(__file__).with_name("run_doc.py"))
PAGES = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))
TWO_RANK_PAGES = {"docs/gathered_parameters.md", "docs/hierarchical.md", "docs/sequence_parallel.md"}
NO_CODE_PAGES = {
    "docs/architecture.md",
    "docs/config.md",
    "docs/differences.md",
    "docs/layout.md",
}  # prose and tables only
TIMEOUT_S = 420


def run_page(page: str, out: Path) -> list:
    if page in TWO_RANK_PAGES:
        port = str(get_free_port())
        cmd = launcher_cmd("--num_procs", "2", "--master_port", port, RUNNER, page, "--out", str(out))
    else:
        cmd = [sys.executable, RUNNER, page, "--out", str(out)]
    env = clean_env()
    if page not in TWO_RANK_PAGES:
        # A one-process page's init_distributed would otherwise rendezvous on 29500: busy there
        # must not fail it.
        env["MASTER_PORT"] = str(get_free_port())
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{page}: exit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return [r for f in sorted(out.glob("rank*.json")) for r in json.loads(f.read_text())]


@pytest.mark.parametrize("page", PAGES)
def test_page_blocks_run(page, tmp_path):
    results = run_page(page, tmp_path)
    failed = [
        f"{page}:{r['line']} (rank {r['rank']}):\n{r['detail']}" for r in results if r["status"] == "failed"
    ]
    assert not failed, "\n\n".join(failed)
    if page in NO_CODE_PAGES:
        assert not results, f"{page} has blocks now: take it out of NO_CODE_PAGES"
        return
    assert any(r["status"] == "ok" for r in results), f"{page}: no block ran: {results}"
    ranks = {r["rank"] for r in results}
    assert ranks == ({0, 1} if page in TWO_RANK_PAGES else {0}), ranks
    for r in results:
        # A skip must say why, in the page (Sybil's bare `skip: next` gives no reason).
        assert r["status"] != "skipped" or len(r["detail"]) > 10, (
            f"{page}:{r['line']} skipped without a reason"
        )
