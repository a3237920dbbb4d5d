"""`python -m deepspeed.tools.zero_codemod`: small synthetic sources, then transformers' modeling_utils.py.

Each synthetic case states a source, runs the codemod on it and checks the rewritten text or
the refusal; the rewritten copy routine is executed with ZeRO off (plain tensors) and on one
rank with ZeRO on (parameters built under `zero.Init`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import deepspeed
from deepspeed.tools.zero_codemod import main, rewrite_source
from tests.unit.common import DistributedTest

pytestmark = pytest.mark.clients

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rewrite(source: str):
    new, sites = rewrite_source(textwrap.dedent(source), "case.py")
    compile(new, "case.py", "exec")
    return new, sites


def counts(sites):
    return len(sites), sum(s.rewritten for s in sites), sum(not s.rewritten for s in sites)


COPY_ROWS = """\
import deepspeed


def copy_rows(old, new, n, z3):
    params = [old.weight, old.bias, new.weight, new.bias]
    # the rows both heads share
    if z3:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            new.weight.data[:n] = old.weight.data[:n]  # copy
            if new.bias is not None:
                new.bias.data[:n] = old.bias.data[:n]
    else:
        new.weight.data[:n] = old.weight.data[:n]  # copy
        if new.bias is not None:
            new.bias.data[:n] = old.bias.data[:n]


def fail_inside(p, z3):
    if z3:
        with deepspeed.zero.GatheredParameters(p):
            raise KeyError("body")
    else:
        raise KeyError("body")
"""


def _rewritten_namespace() -> dict:
    new, sites = rewrite(COPY_ROWS)
    assert counts(sites) == (2, 2, 0)
    namespace: dict = {}
    exec(compile(new, "copy_rows_rewritten.py", "exec"), namespace)
    return namespace


def _heads(zero3: bool):
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    torch.manual_seed(0)
    init = deepspeed.zero.Init(config_dict_or_path=config, enabled=zero3).start()
    old, new = torch.nn.Linear(4, 6), torch.nn.Linear(4, 9)
    init.stop()
    return old, new


def _full(p):
    with deepspeed.zero.GatheredParameters(p):
        return p.detach().clone()


# ----------------------------------------------------------------------------- rewritten


def test_identical_bodies_become_one_body():
    new, sites = rewrite(COPY_ROWS)
    assert counts(sites) == (2, 2, 0)
    assert all(s.reason == "enabled= form" for s in sites)
    expected = textwrap.dedent("""\
        def copy_rows(old, new, n, z3):
            params = [old.weight, old.bias, new.weight, new.bias]
            # the rows both heads share
            gather = deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=z3).start()
            try:
                new.weight.data[:n] = old.weight.data[:n]  # copy
                if new.bias is not None:
                    new.bias.data[:n] = old.bias.data[:n]
            finally:
                gather.stop()
        """)
    assert expected in new
    assert "else" not in new


def test_rewritten_code_runs_with_zero_off():
    namespace = _rewritten_namespace()
    old, new = _heads(zero3=False)
    namespace["copy_rows"](old, new, 6, z3=False)
    assert torch.equal(new.weight[:6], old.weight) and torch.equal(new.bias[:6], old.bias)
    with pytest.raises(KeyError):  # the exception propagates; finally stopped the gather
        namespace["fail_inside"](old.weight, z3=False)
    assert deepspeed.zero.live_contexts() == []


class TestRewrittenRunsUnderZero3(DistributedTest):
    world_size = 1

    def test_rewritten_code_runs_with_zero_on(self):
        namespace = _rewritten_namespace()
        old, new = _heads(zero3=True)
        assert new.weight.data.numel() == 0  # partitioned
        want = {name: _full(p) for name, p in new.named_parameters()}
        for name, p in old.named_parameters():
            want[name][:6] = _full(p)
        namespace["copy_rows"](old, new, 6, z3=True)
        assert new.weight.data.numel() == 0  # released again
        for name, p in new.named_parameters():
            assert torch.equal(_full(p), want[name]), name
        with pytest.raises(KeyError):
            namespace["fail_inside"](old.weight, z3=True)
        assert old.weight.data.numel() == 0 and deepspeed.zero.live_contexts() == []


def test_init_site_through_from_import_alias():
    new, sites = rewrite("""\
        from deepspeed import zero

        def build(cfg, z3):
            if z3 and cfg is not None:
                with zero.Init(config_dict_or_path=cfg):
                    model = Net()
            else:
                model = Net()
            return model
        """)
    assert counts(sites) == (1, 1, 0) and sites[0].kind == "Init"
    assert "zero_init = zero.Init(config_dict_or_path=cfg, enabled=z3 and cfg is not None).start()" in new
    assert "finally:\n        zero_init.stop()" in new


def test_local_import_keeps_the_branch():
    new, sites = rewrite("""\
        def resize(old, gather, flag, z3):
            if z3:
                import deepspeed as ds

                params = [old.weight]
                with ds.runtime.zero.GatheredParameters(params, enabled=flag or gather):
                    n = old.weight.shape[0]
            else:
                n = old.weight.shape[0]
            return n
        """)
    assert counts(sites) == (1, 1, 0)
    # deepspeed is imported only in the branch (it stays optional): start() stays under it
    assert (
        textwrap.dedent("""\
        def resize(old, gather, flag, z3):
            gather_2 = None
            if z3:
                import deepspeed as ds

                params = [old.weight]
                gather_2 = ds.runtime.zero.GatheredParameters(params, enabled=flag or gather).start()
            try:
                n = old.weight.shape[0]
            finally:
                if gather_2 is not None:
                    gather_2.stop()
            return n
        """)
        in new
    )


def test_existing_enabled_combined_with_and():
    new, sites = rewrite("""\
        import deepspeed

        def f(p, z3, flag):
            if z3:
                with deepspeed.zero.GatheredParameters(p, enabled=flag or z3):
                    p.data.zero_()
            else:
                p.data.zero_()
        """)
    assert counts(sites) == (1, 1, 0)
    assert "deepspeed.zero.GatheredParameters(p, enabled=z3 and (flag or z3)).start()" in new


def test_nested_sites():
    new, sites = rewrite("""\
        import deepspeed
        from deepspeed.zero import GatheredParameters as GP

        def f(a, b, z3):
            if z3:
                with deepspeed.zero.Init():
                    m = make(a)
                    if z3:
                        with GP(m.weight, modifier_rank=0):
                            m.weight.data.fill_(1.0)
                    else:
                        m.weight.data.fill_(1.0)
            else:
                m = make(a)
                if z3:
                    with GP(m.weight, modifier_rank=0):
                        m.weight.data.fill_(1.0)
                else:
                    m.weight.data.fill_(1.0)
            return m
        """)
    assert counts(sites) == (2, 2, 0)
    assert "zero_init = deepspeed.zero.Init(enabled=z3).start()" in new
    assert "gather = GP(m.weight, modifier_rank=0, enabled=z3).start()" in new
    assert new.count(".start()") == 2 and new.count("fill_") == 1


def test_idempotent_and_fresh_names():
    source = (
        COPY_ROWS
        + "\n\ndef g(gather, p, z3):\n    if z3:\n        with deepspeed.zero.GatheredParameters(p):\n            gather(p)\n    else:\n        gather(p)\n"
    )
    once, sites = rewrite(source)
    assert counts(sites) == (3, 3, 0)
    assert "gather_2 = deepspeed.zero.GatheredParameters(p, enabled=z3).start()" in once
    twice, sites = rewrite(once)
    assert twice == once and sites == []


# ----------------------------------------------------------------------------- refused


@pytest.mark.parametrize(
    "body, reason",
    [
        (
            """\
            if z3:
                with deepspeed.zero.GatheredParameters(p, modifier_rank=0):
                    if rank() == 0:
                        p.data.zero_()
            else:
                p.data.zero_()
            """,
            "the two bodies differ",
        ),
        (
            """\
            if z3:
                with deepspeed.zero.GatheredParameters(p) as g:
                    p.data.zero_()
            else:
                p.data.zero_()
            """,
            "binds `as NAME`",
        ),
        (
            """\
            if pop_flag():
                with deepspeed.zero.GatheredParameters(p):
                    p.data.zero_()
            else:
                p.data.zero_()
            """,
            "the condition may have side effects (it calls `pop_flag()`)",
        ),
        (
            """\
            if z3:
                with deepspeed.zero.GatheredParameters(p):
                    p.data.zero_()
                deepspeed.zero.register_external_parameter(m, p)
            else:
                p.data.zero_()
            """,
            "statements follow the with-statement",
        ),
        (
            """\
            if z3:
                with deepspeed.zero.GatheredParameters(p):
                    p.data.zero_()  # one comment
            else:
                p.data.zero_()  # another
            """,
            "different comments",
        ),
    ],
)
def test_refused_sites_are_left_untouched(body, reason):
    source = "import deepspeed\n\ndef f(p, m, z3):\n" + textwrap.indent(textwrap.dedent(body), "    ")
    new, sites = rewrite(source)
    assert new == source
    assert counts(sites) == (1, 0, 1)
    assert reason in sites[0].reason
    assert sites[0].report().startswith("case.py:4: refused GatheredParameters site: ")


# ----------------------------------------------------------------------------- the command line


def test_cli_check_diff_and_in_place(tmp_path, capsys):
    path = tmp_path / "mod.py"
    path.write_text(COPY_ROWS)
    assert main(["--check", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{path}:7: would rewrite GatheredParameters site (enabled= form)" in out
    assert out.rstrip().endswith("2 sites found, 2 would be rewritten, 0 refused")
    assert path.read_text() == COPY_ROWS
    assert main(["--diff", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("2 sites found, 2 would be rewritten, 0 refused")  # nothing written
    assert "+    gather = deepspeed.zero.GatheredParameters(" in out and path.read_text() == COPY_ROWS
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("2 sites found, 2 rewritten, 0 refused")
    assert "gather.stop()" in path.read_text()
    assert main(["--check", str(path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("0 sites found, 0 would be rewritten, 0 refused")


def test_transformers_modeling_utils(tmp_path):
    """The codemod on a copy of transformers' modeling_utils.py, as a subprocess."""
    import transformers

    source = os.path.join(os.path.dirname(transformers.__file__), "modeling_utils.py")
    if "gather.stop()" in open(source).read():
        pytest.skip("this transformers was already rewritten by the codemod")
    copy = tmp_path / "modeling_utils.py"
    shutil.copy(source, copy)
    result = subprocess.run(
        [sys.executable, "-m", "deepspeed.tools.zero_codemod", str(copy)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "10 sites found, 9 rewritten, 1 refused", result.stdout
    refused = [line for line in lines if "refused GatheredParameters site" in line]
    assert len(refused) == 1 and "the two bodies differ" in refused[0]
    rewritten = copy.read_text()
    compile(rewritten, str(copy), "exec")
    assert rewritten.count("with deepspeed.zero.GatheredParameters") == 1  # the refused one
    assert rewritten.count(".stop()") == 9
