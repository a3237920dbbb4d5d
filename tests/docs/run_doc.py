"""Run every fenced block of one Markdown page through Sybil; print one JSON line per block.

    python tests/docs/run_doc.py docs/zero_init.md                    # one process
    deepspeed --num_procs 2 tests/docs/run_doc.py docs/gathered_parameters.md --out DIR

`test_docs.py` runs this as a subprocess, so each page gets a fresh process (a page's
`zero.Init` or process group cannot leak into the rest of the suite), and pages whose
blocks are about ranks run under the launcher at 2 processes.

What runs, per block language (Sybil's parsers; the page marks what does not run):
- ``python``: in one namespace per page, in order, as the page reads; a block with ``>>>``
  lines is a doctest, so the output it claims is compared.
- ``python file=NAME``: saved as NAME in the page's working directory, for a later shell
  block to run.
- ``bash``: run by bash (``-e``: the first failing command fails the block) in that working
  directory, where ``examples/`` points at the repository's; on rank 0 only.
- ``<!-- skip: next "reason" -->`` before a block: not run, reported as skipped with the
  reason (illustration only).
Blocks in other languages (``json``, ``text``, none) are not code and are not run.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from unittest import SkipTest

from sybil import Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parents[2]
SHELL_TIMEOUT_S = 240


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class SaveAsFileParser(CodeBlockParser):
    """```python file=NAME``` blocks: the page says "save this as NAME"; the test does."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(language="python")
        self.workdir = workdir

    def __call__(self, document):
        for region in self.lexers(document):
            language = region.lexemes["arguments"]
            if language.startswith("python file="):
                region.parsed = (language.split("=", 1)[1].strip(), region.lexemes["source"])
                region.evaluator = self.evaluate
                yield region

    def evaluate(self, example) -> None:
        name, source = example.parsed
        (self.workdir / name).write_text(str(source))


def shell_evaluator(workdir: Path):
    env = dict(os.environ)
    # The documented commands (`deepspeed`, `ds_report`, `zero_to_fp32`) come from this venv.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a documented `deepspeed ...` starts its own ranks

    def evaluate(example) -> None:
        if _rank() != 0:
            return  # one rank runs a page's commands
        script = str(example.parsed)
        proc = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=SHELL_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise AssertionError(
                f"exit status {proc.returncode} from:\n{script}\n--- stdout\n{proc.stdout[-3000:]}"
                f"\n--- stderr\n{proc.stderr[-3000:]}"
            )

    return evaluate


def page_sybil(workdir: Path) -> Sybil:
    return Sybil(
        parsers=[
            SkipParser(),
            PythonCodeBlockParser(),
            SaveAsFileParser(workdir),
            CodeBlockParser(language="bash", evaluator=shell_evaluator(workdir)),
        ]
    )


def run_page(page: str) -> list:
    """[{"line", "status" (ok / skipped / failed), "detail"}] for each block of `page`."""
    workdir = Path(tempfile.mkdtemp(prefix="doc_test_"))
    (workdir / "examples").symlink_to(ROOT / "examples")
    document = page_sybil(workdir).parse(ROOT / page)
    document.namespace["__name__"] = "__doc_page__"
    os.chdir(workdir)
    results = []
    for example in document:
        try:
            example.evaluate()
            results.append({"line": example.line, "status": "ok", "detail": ""})
        except SkipTest as skip:
            results.append({"line": example.line, "status": "skipped", "detail": str(skip)})
        except Exception:  # report every block, not only the first failure
            results.append(
                {"line": example.line, "status": "failed", "detail": traceback.format_exc()[-4000:]}
            )
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description="run one Markdown page's blocks")
    parser.add_argument("page", help="path relative to the repository root")
    parser.add_argument("--out", help="folder for rank<N>.json (ranks sharing one stdout interleave)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher; unused")
    args = parser.parse_args()
    results = [{"rank": _rank(), "page": args.page, **r} for r in run_page(args.page)]
    if args.out:
        Path(args.out, f"rank{_rank()}.json").write_text(json.dumps(results))
    for result in results:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
