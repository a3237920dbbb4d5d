"""Rewrite duplicated ZeRO-3 branches into one body with `start()` / `stop()`.

    python -m deepspeed.tools.zero_codemod PATH...           # rewrite in place
    python -m deepspeed.tools.zero_codemod --check PATH...   # report only; exit 1 if a file would change
    python -m deepspeed.tools.zero_codemod --diff PATH...    # print a unified diff; write nothing

A *site* is an `if` statement with an `else` whose first branch ends in a `with` over
`deepspeed.zero.GatheredParameters(...)` or `deepspeed.zero.Init(...)` (reached through any
import spelling: `import deepspeed`, `import deepspeed as ds`, `from deepspeed import zero`,
`from deepspeed.zero import GatheredParameters as GP`, an import local to the function, or
the `deepspeed.runtime.zero` paths). When the `with` body and the `else` body are the same
statements, the site becomes one body:

    gather = deepspeed.zero.GatheredParameters(ARGS, enabled=COND).start()
    try:
        BODY
    finally:
        gather.stop()

That short form is used when the ZeRO branch holds nothing but the `with`, the arguments have
no side effects and `deepspeed` is imported unconditionally at the top of the module. In every
other case (typically transformers' `import deepspeed` inside the branch, so that deepspeed
stays optional) the branch's own statements stay under the condition:

    gather = None
    if COND:
        import deepspeed
        gather = deepspeed.zero.GatheredParameters(ARGS).start()
    try:
        BODY
    finally:
        if gather is not None:
            gather.stop()

Both forms evaluate COND once and run BODY once, as before; `finally` makes an exception in
BODY still stop the context object and then propagate, exactly as leaving the `with` did.

A site is refused (left untouched, one report line with file:line and the reason) when the two
bodies differ, when the condition may have side effects (it calls something that is not a
predicate such as `is_*()` / `has_*()` / `*_enabled()` / `*_available()` / `isinstance`), when the
`with` binds `as NAME`, enters several context managers or is `async`, when statements follow
the `with` in the ZeRO branch, when the `else` is an `elif` chain, or when the two bodies carry
different comments (one of them would be lost).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional, Union

try:
    import libcst as cst
except ImportError as exc:  # a development tool: libcst is not a runtime dependency of deepspeed
    raise ImportError(
        "deepspeed.tools.zero_codemod needs libcst: pip install libcst (pinned in requirements/requirements-dev.txt)"
    ) from exc
from libcst.helpers import get_full_name_for_node
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedNameProvider

GATHER = "GatheredParameters"
INIT = "Init"
_MODULE_PATHS = ("deepspeed.zero", "deepspeed.runtime.zero", "deepspeed.runtime.zero.partition_parameters")
_TARGETS = {f"{mod}.{cls}": cls for mod in _MODULE_PATHS for cls in (GATHER, INIT)}
_TARGETS = types.MappingProxyType(_TARGETS)  # read-only from here on
_VARIABLE = {GATHER: "gather", INIT: "zero_init"}
_VARIABLE = types.MappingProxyType(_VARIABLE)  # read-only from here on
_MENTIONS_TARGET = re.compile(rf"\b({GATHER}|{INIT})\b")

# Calls a condition may make and still count as free of side effects.
_PURE_CALLS = frozenset(
    {"isinstance", "issubclass", "hasattr", "getattr", "callable", "len", "bool", "type", "id", "any", "all"}
)
_PREDICATE_NAME = re.compile(r"^_*(is|has)_|_(enabled|available)$")


@dataclass
class Site:
    """One `if COND: with ZERO(...): A else: B` site and what the codemod did with it."""

    path: str
    line: int
    kind: str  # GATHER or INIT
    rewritten: bool
    reason: str = ""  # why it was refused; how it was rewritten

    def report(self, dry_run: bool = False) -> str:
        if self.rewritten:
            verb = "would rewrite" if dry_run else "rewrote"
            return f"{self.path}:{self.line}: {verb} {self.kind} site ({self.reason})"
        return f"{self.path}:{self.line}: refused {self.kind} site: {self.reason}"


# ----------------------------------------------------------------------------- small analyses


class _EffectFinder(cst.CSTVisitor):
    """Finds the first construct in an expression that may have a side effect."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None

    def _flag(self, why: str) -> None:
        if self.reason is None:
            self.reason = why

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._flag("assigns with `:=`")

    def visit_Await(self, node: cst.Await) -> None:
        self._flag("awaits")

    def visit_Yield(self, node: cst.Yield) -> None:
        self._flag("yields")

    def visit_Call(self, node: cst.Call) -> None:
        name = get_full_name_for_node(node.func) or "<expression>"
        last = name.rsplit(".", 1)[-1]
        if last not in _PURE_CALLS and not _PREDICATE_NAME.search(last):
            self._flag(f"calls `{name}()`")


def side_effect(expr: cst.CSTNode) -> Optional[str]:
    """Why `expr` may have a side effect, or None when it looks pure."""
    finder = _EffectFinder()
    expr.visit(finder)
    return finder.reason


class _CommentCollector(cst.CSTVisitor):
    def __init__(self) -> None:
        self.comments: list[str] = []

    def visit_Comment(self, node: cst.Comment) -> None:
        self.comments.append(node.value.strip())


def _comments(node: cst.CSTNode) -> list[str]:
    collector = _CommentCollector()
    node.visit(collector)
    return collector.comments


class _NameCollector(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)


def _as_block(suite: cst.BaseSuite) -> cst.IndentedBlock:
    """A one-line suite (`else: x = 1`) as an indented block."""
    if isinstance(suite, cst.IndentedBlock):
        return suite
    assert isinstance(suite, cst.SimpleStatementSuite)
    return cst.IndentedBlock(
        body=[cst.SimpleStatementLine(body=suite.body)], header=suite.trailing_whitespace
    )


def _statement_shape(stmt: cst.BaseStatement) -> str:
    """A statement's meaning without its formatting and comments (its AST dump)."""
    code = cst.Module(body=[stmt.with_changes(leading_lines=[])]).code
    try:
        return ast.dump(ast.parse(code))
    except SyntaxError:
        return code


def _unconditional_imports(module: cst.Module) -> set[str]:
    """Names bound by `import` / `from ... import` statements at the top level of the module."""
    bound: set[str] = set()
    for stmt in module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if isinstance(small, cst.Import):
                for alias in small.names:
                    if alias.asname is not None:
                        bound.add(get_full_name_for_node(alias.asname.name) or "")
                    else:
                        bound.add((get_full_name_for_node(alias.name) or "").split(".")[0])
            elif isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                for alias in small.names:
                    target = alias.asname.name if alias.asname is not None else alias.name
                    bound.add(get_full_name_for_node(target) or "")
    return bound


def _root_name(expr: cst.BaseExpression) -> Optional[str]:
    while isinstance(expr, cst.Attribute):
        expr = expr.value
    return expr.value if isinstance(expr, cst.Name) else None


def _needs_parens(expr: cst.BaseExpression) -> bool:
    if expr.lpar:
        return False
    if isinstance(expr, cst.BooleanOperation):
        return isinstance(expr.operator, cst.Or)
    return isinstance(expr, (cst.IfExp, cst.Lambda, cst.NamedExpr))


def _parenthesized(expr: cst.BaseExpression) -> cst.BaseExpression:
    if _needs_parens(expr):
        return expr.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return expr


def _comment_lines(*comments: Optional[cst.Comment]) -> list[cst.EmptyLine]:
    return [cst.EmptyLine(comment=c) for c in comments if c is not None]


# ----------------------------------------------------------------------------- the rewrite


@dataclass
class _Plan:
    site: Site
    kind: str
    variable: str
    short_form: bool  # `X(ARGS, enabled=COND).start()` rather than `if COND: v = X(ARGS).start()`
    keep: str  # "with" or "else": which body becomes the single body


class _Rewriter(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider)

    def __init__(self, path: str, used_names: set[str], top_level_imports: set[str]) -> None:
        super().__init__()
        self.path = path
        self.sites: list[Site] = []
        self._scopes = [used_names]  # names in use: the module's, then each enclosing function's
        self._top_level_imports = top_level_imports
        self._plans: dict[cst.If, _Plan] = {}
        self._elifs: set[cst.If] = set()
        self._dropped: set[cst.CSTNode] = set()  # the body a rewrite discards: not visited

    # --- recognition

    def _zero_kind(self, expr: cst.BaseExpression) -> Optional[str]:
        if not isinstance(expr, cst.Call):
            return None
        names = {q.name for q in self.get_metadata(QualifiedNameProvider, expr.func, set())}
        if not names:  # a name no import in this file binds (a global set elsewhere)
            full = get_full_name_for_node(expr.func)
            names = {full} if full else set()
        for name in names:
            if name in _TARGETS:
                return _TARGETS[name]
        return None

    def _fresh(self, base: str) -> str:
        """A name no code in the enclosing function (or module, at top level) uses yet."""
        used = self._scopes[-1]
        name, n = base, 2
        while name in used:
            name, n = f"{base}_{n}", n + 1
        used.add(name)
        return name

    def visit_FunctionDef(self, node: cst.FunctionDef) -> Optional[bool]:
        names = _NameCollector()
        node.visit(names)
        self._scopes.append(names.names)
        return True

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        self._scopes.pop()
        return updated_node

    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    # --- deciding, on the original tree

    def visit_If(self, node: cst.If) -> Optional[bool]:
        if isinstance(node.orelse, cst.If):
            self._elifs.add(node.orelse)
        if not isinstance(node.body, cst.IndentedBlock) or node.orelse is None:
            return True
        withs = [
            (i, s)
            for i, s in enumerate(node.body.body)
            if isinstance(s, cst.With) and any(self._zero_kind(item.item) for item in s.items)
        ]
        if not withs:
            return True
        index, with_node = withs[-1]
        kind = next(k for k in (self._zero_kind(item.item) for item in with_node.items) if k)
        site = Site(self.path, self._line(node), kind, rewritten=False)
        self.sites.append(site)
        refusal = self._refusal(node, withs, index, with_node)
        if refusal is not None:
            site.reason = refusal
            return True
        plan = self._plan(node, with_node, site, kind)
        if isinstance(plan, str):
            site.reason = plan
            return True
        site.rewritten = True
        site.reason = "enabled= form" if plan.short_form else "start() under the condition, stop() in finally"
        self._plans[node] = plan
        assert isinstance(node.orelse, cst.Else)
        self._dropped.add(node.orelse.body if plan.keep == "with" else with_node.body)
        return True

    def _refusal(self, node: cst.If, withs: list, index: int, with_node: cst.With) -> Optional[str]:
        if node in self._elifs:
            return "the if is an elif branch; rewrite the chain by hand"
        if isinstance(node.orelse, cst.If):
            return "the other branch is an elif chain, not a plain else"
        if len(withs) > 1:
            return "the ZeRO branch has more than one ZeRO with-statement"
        if index != len(node.body.body) - 1:
            return "statements follow the with-statement in the ZeRO branch"
        if with_node.asynchronous is not None:
            return "async with"
        if len(with_node.items) > 1:
            return "the with-statement enters several context managers"
        if with_node.items[0].asname is not None:
            return (
                "the with-statement binds `as NAME`; its body may use the context object, "
                "which the else branch does not have"
            )
        effect = side_effect(node.test)
        if effect is not None:
            return f"the condition may have side effects (it {effect})"
        return None

    def _plan(self, node: cst.If, with_node: cst.With, site: Site, kind: str) -> Union[_Plan, str]:
        assert isinstance(node.orelse, cst.Else)
        zero_body = _as_block(with_node.body).body
        else_body = _as_block(node.orelse.body).body
        zero_shapes = [_statement_shape(s) for s in zero_body]
        else_shapes = [_statement_shape(s) for s in else_body]
        if zero_shapes != else_shapes:
            for i, (a, b) in enumerate(zip(zero_shapes, else_shapes)):
                if a != b:
                    return (
                        f"the two bodies differ (the with body's line {self._line(zero_body[i])} "
                        f"vs the else body's line {self._line(else_body[i])})"
                    )
            return (
                f"the two bodies differ (the with body has {len(zero_body)} statements, "
                f"the else body {len(else_body)})"
            )
        zero_comments = _comments(with_node.body)
        else_comments = _comments(node.orelse.body)
        if set(else_comments) <= set(zero_comments):
            keep = "with"
        elif set(zero_comments) <= set(else_comments):
            keep = "else"
        else:
            lost = sorted(set(zero_comments) ^ set(else_comments))
            return f"the two bodies carry different comments (one of {lost} would be lost)"
        call = with_node.items[0].item
        assert isinstance(call, cst.Call)
        short_form = (
            len(node.body.body) == 1
            and all(arg.star == "" for arg in call.args)
            and all(side_effect(arg.value) is None for arg in call.args)
            and _root_name(call.func) in self._top_level_imports
        )
        return _Plan(site, kind, self._fresh(_VARIABLE[kind]), short_form, keep)

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> Optional[bool]:
        return node not in self._dropped

    # --- rewriting, on the updated tree

    def leave_If(
        self, original_node: cst.If, updated_node: cst.If
    ) -> Union[cst.BaseStatement, cst.FlattenSentinel[cst.BaseStatement]]:
        plan = self._plans.pop(original_node, None)
        if plan is None:
            return updated_node
        node = updated_node
        assert isinstance(node.body, cst.IndentedBlock) and isinstance(node.orelse, cst.Else)
        with_node = node.body.body[-1]
        assert isinstance(with_node, cst.With)
        call = with_node.items[0].item
        assert isinstance(call, cst.Call)
        body = _as_block(with_node.body if plan.keep == "with" else node.orelse.body)
        else_header = node.orelse.body.header if isinstance(node.orelse.body, cst.IndentedBlock) else None
        before_try = [
            *node.body.footer,
            *node.orelse.leading_lines,
            *_comment_lines(else_header.comment if else_header is not None else None),
        ]
        if plan.keep == "else":  # the with body's own header comment, if any, rides along
            before_try += _comment_lines(
                with_node.body.header.comment if isinstance(with_node.body, cst.IndentedBlock) else None
            )
        variable = cst.Name(plan.variable)
        stop_line = cst.SimpleStatementLine(
            body=[cst.Expr(cst.Call(func=cst.Attribute(value=variable, attr=cst.Name("stop"))))]
        )
        if plan.short_form:
            started = self._start_call(self._with_enabled(call, node.test))
            lead = [
                *node.leading_lines,
                *_comment_lines(node.body.header.comment),
                *(line for line in with_node.leading_lines if line.comment is not None),
            ]
            first = cst.SimpleStatementLine(
                body=[cst.Assign(targets=[cst.AssignTarget(target=variable)], value=started)],
                leading_lines=lead,
            )
            finally_body = [stop_line]
        else:
            start_line = cst.SimpleStatementLine(
                body=[cst.Assign(targets=[cst.AssignTarget(target=variable)], value=self._start_call(call))],
                leading_lines=with_node.leading_lines,
            )
            first = cst.SimpleStatementLine(
                body=[cst.Assign(targets=[cst.AssignTarget(target=variable)], value=cst.Name("None"))],
                leading_lines=node.leading_lines,
            )
            guarded = node.with_changes(
                leading_lines=[],
                body=node.body.with_changes(body=[*node.body.body[:-1], start_line], footer=[]),
                orelse=None,
            )
            finally_body = [
                cst.If(
                    test=cst.Comparison(
                        left=variable, comparisons=[cst.ComparisonTarget(cst.IsNot(), cst.Name("None"))]
                    ),
                    body=cst.IndentedBlock(body=[stop_line]),
                )
            ]
        attempt = cst.Try(
            body=body,
            finalbody=cst.Finally(body=cst.IndentedBlock(body=finally_body)),
            leading_lines=before_try,
        )
        if plan.short_form:
            return cst.FlattenSentinel([first, attempt])
        return cst.FlattenSentinel([first, guarded, attempt])

    @staticmethod
    def _start_call(call: cst.Call) -> cst.Call:
        return cst.Call(func=cst.Attribute(value=call, attr=cst.Name("start")))

    @staticmethod
    def _with_enabled(call: cst.Call, condition: cst.BaseExpression) -> cst.Call:
        """`call` with `enabled=condition`, or `enabled=(condition) and (existing)`."""
        args = list(call.args)
        for i, arg in enumerate(args):
            if arg.keyword is not None and arg.keyword.value == "enabled":
                combined = cst.BooleanOperation(
                    left=_parenthesized(condition), operator=cst.And(), right=_parenthesized(arg.value)
                )
                args[i] = arg.with_changes(value=combined)
                return call.with_changes(args=args)
        new_arg = cst.Arg(
            keyword=cst.Name("enabled"),
            value=condition,
            equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")
            ),
        )
        if args:
            last = args[-1]
            separator = args[-2].comma if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) else None
            if separator is None:
                separator = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            args[-1] = last.with_changes(comma=separator)
            new_arg = new_arg.with_changes(comma=last.comma)
        return call.with_changes(args=[*args, new_arg])


def rewrite_source(source: Union[str, bytes], path: str = "<string>") -> tuple[Union[str, bytes], list[Site]]:
    """Rewrite every eligible site in `source`; returns the new source (same type) and the sites."""
    text = source if isinstance(source, str) else source.decode("utf-8", "replace")
    if not _MENTIONS_TARGET.search(text):  # every spelling of either class names it somewhere
        return source, []
    module = cst.parse_module(source)
    names = _NameCollector()
    module.visit(names)
    rewriter = _Rewriter(path, names.names, _unconditional_imports(module))
    new_module = MetadataWrapper(module).visit(rewriter)
    if not any(site.rewritten for site in rewriter.sites):
        return source, rewriter.sites
    return (new_module.bytes if isinstance(source, bytes) else new_module.code), rewriter.sites


# ----------------------------------------------------------------------------- the command line


def _python_files(paths: Sequence[str]) -> Iterator[str]:
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
                for name in sorted(files):
                    if name.endswith(".py"):
                        yield os.path.join(root, name)
        else:
            yield path


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deepspeed.tools.zero_codemod",
        description="Rewrite duplicated `if zero3: with GatheredParameters/Init(...): X else: X` "
        "blocks into one body with start()/stop().",
    )
    parser.add_argument("paths", nargs="+", help="Python files or directories (searched for *.py)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="report only; exit 1 if any file would change")
    mode.add_argument("--diff", action="store_true", help="print a unified diff instead of writing")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only refusals and the summary")
    args = parser.parse_args(argv)

    dry_run = args.check or args.diff
    found = rewritten = refused = 0
    changed_files = 0
    status = 0
    for path in _python_files(args.paths):
        try:
            with open(path, "rb") as f:
                source = f.read()
        except OSError as exc:
            print(f"{path}: skipped: {exc}", file=sys.stderr)
            status = 2
            continue
        try:
            new_source, sites = rewrite_source(source, path)
        except cst.ParserSyntaxError as exc:
            print(f"{path}: skipped: libcst cannot parse it ({str(exc).splitlines()[0]})", file=sys.stderr)
            continue
        if new_source != source:
            try:
                compile(new_source, path, "exec", dont_inherit=True)
            except SyntaxError as exc:  # a bug in this tool; never write such a file
                print(f"{path}: not written: the rewrite does not compile ({exc})", file=sys.stderr)
                status = 2
                continue
        for site in sites:
            found += 1
            rewritten += site.rewritten
            refused += not site.rewritten
            if not (args.quiet and site.rewritten):
                print(site.report(dry_run))
        if new_source == source:
            continue
        changed_files += 1
        if args.diff:
            old_text = source.decode("utf-8", "replace").splitlines(keepends=True)
            new_text = new_source.decode("utf-8", "replace").splitlines(keepends=True)
            sys.stdout.writelines(difflib.unified_diff(old_text, new_text, f"a/{path}", f"b/{path}"))
        elif not args.check:
            with open(path, "wb") as f:
                f.write(new_source)
    verb = "would be rewritten" if dry_run else "rewritten"  # --check / --diff write nothing
    print(f"{found} sites found, {rewritten} {verb}, {refused} refused")
    if args.check and changed_files:
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
