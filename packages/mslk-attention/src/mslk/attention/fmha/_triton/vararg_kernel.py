"""Triton kernels over a variable number of tensors, written once and specialized for N of them (spec U-06).

Triton's kernels take a fixed list of arguments. A kernel written with "arrays" of arguments is rewritten from its
source for a given N before it is compiled:

- a parameter annotated `"VAR_ARGS_ARRAY"` (or Python's `*args`) becomes N parameters `name0 … name{N-1}`;
  a local variable declared `name: "VAR_ARGS_ARRAY"` becomes N locals;
- `len(name)` is N;
- `for i in range(len(name)): …` runs over the N of them: in `VarargMode.UNROLL` (the default) its body is
  repeated N times with i a constant and `name[i]` the i-th parameter (or local, which may be assigned); in
  `VarargMode.CONDITIONAL` the loop stays, and `name[i]` reads `name0 if i == 0 else name1 if i == 1 else …`
  (a smaller kernel to compile for large N; array elements can only be read).

MSLK's own kernels take tuples of tensors instead, which Triton supports now; this is for kernels written the
xformers / reference-MSLK way.
"""

from __future__ import annotations

import ast
import copy
import enum
import functools
import inspect
import itertools
import linecache
import operator
import textwrap

import triton

VAR_ARGS_ARRAY = "VAR_ARGS_ARRAY"  # the annotation that marks an array of arguments (a string: no import needed)


class VarargMode(enum.Enum):
    UNROLL = "unroll"
    CONDITIONAL = "conditional"


def _is_array_annotation(annotation: ast.expr | None) -> bool:
    return (isinstance(annotation, ast.Constant) and annotation.value == VAR_ARGS_ARRAY) or (
        isinstance(annotation, ast.Name) and annotation.id == VAR_ARGS_ARRAY
    )


def _loop_array(node: ast.For) -> str | None:
    """The array name of `for i in range(len(name))` (i a plain name), else None."""
    loop = node.iter
    if not (
        isinstance(node.target, ast.Name)
        and isinstance(loop, ast.Call)
        and isinstance(loop.func, ast.Name)
        and loop.func.id == "range"
        and len(loop.args) == 1
        and not loop.keywords
    ):
        return None
    length = loop.args[0]
    if (
        isinstance(length, ast.Call)
        and isinstance(length.func, ast.Name)
        and length.func.id == "len"
        and len(length.args) == 1
        and isinstance(length.args[0], ast.Name)
    ):
        return length.args[0].id
    return None


_FOLDED = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod}  # fmt: skip


def _constant_index(index: ast.expr) -> int | None:
    """The value of an index made of integer constants and + - * // % (an unrolled loop's `i + 1`), else None."""
    if isinstance(index, ast.Constant):
        return index.value if type(index.value) is int else None
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, ast.USub):
        value = _constant_index(index.operand)
        return None if value is None else -value
    if isinstance(index, ast.BinOp) and type(index.op) in _FOLDED:
        left, right = _constant_index(index.left), _constant_index(index.right)
        if left is not None and right is not None and not (right == 0 and isinstance(index.op, ast.FloorDiv | ast.Mod)):
            return _FOLDED[type(index.op)](left, right)
    return None


class _Substitute(ast.NodeTransformer):
    """Replaces the loads of one name by a constant (an unrolled loop's index)."""

    def __init__(self, name: str, value: int):
        self.name, self.value = name, value

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id == self.name and isinstance(node.ctx, ast.Load):
            return ast.copy_location(ast.Constant(self.value), node)
        return node


class _VisitorUnrollKernel(ast.NodeTransformer):
    """Rewrites a kernel's source for N elements of each argument array (VarargMode.UNROLL)."""

    def __init__(self, N: int):
        if not isinstance(N, int) or N < 1:
            raise ValueError(f"unroll_varargs: N must be a positive int, got {N!r}")
        self.N = N
        self.arrays: set[str] = set()

    def _names(self, name: str) -> list[str]:
        return [f"{name}{i}" for i in range(self.N)]

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        params = []
        for arg in node.args.args:
            if _is_array_annotation(arg.annotation):
                self.arrays.add(arg.arg)
                params += [ast.arg(name) for name in self._names(arg.arg)]
            else:
                params.append(arg)
        if node.args.vararg is not None:  # *name: the array's elements, then the keyword-only parameters
            self.arrays.add(node.args.vararg.arg)
            params += [ast.arg(name) for name in self._names(node.args.vararg.arg)]
            if node.args.defaults or any(default is not None for default in node.args.kw_defaults):
                raise ValueError(f"unroll_varargs: {node.name} takes *{node.args.vararg.arg} and has default values")
            params += node.args.kwonlyargs
            node.args.vararg, node.args.kwonlyargs, node.args.kw_defaults = None, [], []
        # (positional defaults stay with the last parameters: arrays, which have none, come before them)
        node.args.args = params
        # Every array is known (the locals' declarations are statements of the body) before any loop is rewritten.
        for statement in ast.walk(node):
            if isinstance(statement, ast.AnnAssign) and _is_array_annotation(statement.annotation):
                if not isinstance(statement.target, ast.Name) or statement.value is not None:
                    raise ValueError(f"unroll_varargs: declare an array as `name: {VAR_ARGS_ARRAY!r}`, alone")
                self.arrays.add(statement.target.id)
        node.decorator_list = []  # (triton.jit is applied again to the rewritten function)
        return self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST | None:
        return None if _is_array_annotation(node.annotation) else self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if (
            isinstance(node.func, ast.Name)
            and node.func.id == "len"
            and len(node.args) == 1
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in self.arrays
        ):
            return ast.copy_location(ast.Constant(self.N), node)
        return self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        if isinstance(node.value, ast.Name) and node.value.id in self.arrays:
            node.slice = self.visit(node.slice)  # (len(name) in it is N)
            index = _constant_index(node.slice)
            if index is None:
                return self._element(node)
            if not 0 <= index < self.N:
                raise ValueError(f"unroll_varargs: {ast.unparse(node)}: past the array's {self.N} elements")
            return ast.copy_location(ast.Name(f"{node.value.id}{index}", node.ctx), node)
        return self.generic_visit(node)

    def _element(self, node: ast.Subscript) -> ast.AST:
        raise ValueError(
            f"unroll_varargs: {ast.unparse(node)}: an argument array is indexed by constants, or by the variable of "
            f"`for i in range(len({node.value.id}))` (unrolled)"
        )

    def visit_For(self, node: ast.For) -> ast.AST | list[ast.AST]:
        array = _loop_array(node)
        if array not in self.arrays:
            return self.generic_visit(node)
        if node.orelse:
            raise ValueError(f"unroll_varargs: the loop over {array} has an else branch")
        return self._loop(node)

    def _loop(self, node: ast.For) -> list[ast.AST]:
        unrolled = []
        for i in range(self.N):
            substitute = _Substitute(node.target.id, i)
            unrolled += [self.visit(substitute.visit(copy.deepcopy(statement))) for statement in node.body]
        return [statement for statement in unrolled if statement is not None]


class _VisitorConditionalKernel(_VisitorUnrollKernel):
    """As _VisitorUnrollKernel, but loops over arrays stay loops of N steps, reading an array's element i through
    a chain of conditional expressions (VarargMode.CONDITIONAL)."""

    def _element(self, node: ast.Subscript) -> ast.AST:
        if not isinstance(node.ctx, ast.Load):
            raise ValueError(f"unroll_varargs: {ast.unparse(node)}: VarargMode.CONDITIONAL reads arrays, never writes")
        names = self._names(node.value.id)
        index = self.visit(node.slice)
        chain: ast.expr = ast.Name(names[-1], ast.Load())
        for i in reversed(range(self.N - 1)):
            test = ast.Compare(copy.deepcopy(index), [ast.Eq()], [ast.Constant(i)])
            chain = ast.IfExp(test, ast.Name(names[i], ast.Load()), chain)
        return ast.copy_location(chain, node)

    def _loop(self, node: ast.For) -> ast.AST:
        node.iter = ast.copy_location(ast.Call(ast.Name("range", ast.Load()), [ast.Constant(self.N)], []), node.iter)
        return self.generic_visit(node)


_rewrites = itertools.count()


@functools.cache
def unroll_varargs(kernel, N: int, mode: VarargMode = VarargMode.UNROLL):
    """The Triton kernel `kernel` (a `triton.jit` function) rewritten for N elements of each of its argument arrays
    (see the module docstring), compiled by `triton.jit`; cached by (kernel, N, mode)."""
    if not hasattr(kernel, "fn"):
        raise TypeError(f"unroll_varargs: expected a triton.jit function, got {type(kernel).__name__}")
    visitor = {VarargMode.UNROLL: _VisitorUnrollKernel, VarargMode.CONDITIONAL: _VisitorConditionalKernel}[
        VarargMode(mode)
    ](N=N)
    tree = ast.parse(textwrap.dedent(inspect.getsource(kernel.fn)))
    source = ast.unparse(ast.fix_missing_locations(visitor.visit(tree)))
    # Triton reads a kernel's source through `inspect`, which reads it through linecache: the rewritten source is
    # entered there under a file name of its own (no modification time: never dropped as stale).
    filename = f"<unroll_varargs {kernel.fn.__name__} N={N} {VarargMode(mode).value} #{next(_rewrites)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), kernel.fn.__globals__, namespace)
    (function,) = namespace.values()
    return triton.jit(function)
