import logging

import pytest
import torch

from mslk.core import registry, testing
from mslk.core.registry import NotSupportedError


def _inputs(rows=4, cols=6):
    return testing.randn(rows, cols, dtype=torch.bfloat16), testing.randn(rows)


def test_cpu_call_runs_the_reference(fresh_ops):
    op = fresh_ops()
    x, s = _inputs()
    testing.assert_rel_close(op(x, s), (x.double() * s.double()[:, None]).to(torch.bfloat16))


def test_not_supported_text(fresh_ops):
    op = fresh_ops(devices=("cpu",))
    op.backends[-1] = registry.Backend(registry.REFERENCE, op.reference, frozenset({"cuda"}))
    x = testing.randn(2, 3, 4)
    with pytest.raises(NotSupportedError) as info:
        op(x, testing.randn(2))
    lines = str(info.value).splitlines()
    assert lines[0] == f"No operator found for `{op.qualname}` with inputs:"
    assert lines[1] == "     x           : shape=(2, 3, 4) (torch.float32) device=cpu stride=(12, 4, 1)"
    assert lines[2] == "     scale       : shape=(2,) (torch.float32) device=cpu stride=(1,)"
    assert lines[3:7] == [
        "`triton` is not supported because:",
        "    x.dim() == 3 (supported: 2)",
        "`reference` is not supported because:",
        "    device=cpu (supported: cuda)",
    ]
    assert lines[7].startswith("Next step: run `mslk env`")


def test_not_supported_is_a_not_implemented_error():
    assert issubclass(NotSupportedError, NotImplementedError)


def test_format_matches_the_xformers_layout():
    q = torch.empty(2, 498, 8, 32, dtype=torch.float16)
    text = registry.format_not_supported(
        "No operator found for `memory_efficient_attention_forward` with inputs:",
        {"query": q, "p": 0.0},
        {"fa2F@2.x.y-pt": ["attn_bias type is <class 'torch.Tensor'>"]},
        detailed=False,
    )
    assert text == (
        "No operator found for `memory_efficient_attention_forward` with inputs:\n"
        "     query       : shape=(2, 498, 8, 32) (torch.float16)\n"
        "     p           : 0.0\n"
        "`fa2F@2.x.y-pt` is not supported because:\n"
        "    attn_bias type is <class 'torch.Tensor'>"
    )


def test_backends_in_priority_order_first_supporting_wins(fresh_ops):
    op = fresh_ops(devices=("cpu",))
    calls = []
    op.backend("second", devices=("cpu",))(lambda x, s: calls.append("second") or x.clone())
    x, s = _inputs()
    assert op.select((x, s), {}).name == "triton"
    # A non-contiguous row makes the first backend refuse; the second takes it.
    xt = x.t().contiguous().t()
    assert op.select((xt, s), {}).name == "second"
    assert [b.name for b in op.backends] == ["triton", "second", "reference"]
    op.backend("first", devices=("cpu",), before="triton")(lambda x, s: x.clone())
    assert [b.name for b in op.backends] == ["first", "triton", "second", "reference"]
    with pytest.raises(ValueError, match="has no backend 'nope'"):
        op.backend("third", before="nope")


def test_pin_by_argument_and_by_env(fresh_ops, monkeypatch):
    op = fresh_ops(devices=("cpu",))
    x, s = _inputs()
    assert op.select((x, s), {}, pinned="reference").name == "reference"
    monkeypatch.setenv("MSLK_BACKEND", f"{op.qualname}=reference")
    assert op.select((x, s), {}).name == "reference"
    monkeypatch.setenv("MSLK_BACKEND", f"{op.name}=triton")
    assert op.select((x, s), {}).name == "triton"
    monkeypatch.setenv("MSLK_BACKEND", "no_such_everywhere, reference")
    assert op.select((x, s), {}).name == "reference"


def test_pinned_backend_takes_the_schemas_names(fresh_ops):
    """A pinned call goes through torch.ops, so its backend gets keyword arguments as torch.ops passes them, by
    position (its parameters may be named otherwise: `x, scale` here, `a, b` in the backend), and a bad call gets
    torch's error."""
    op = registry.Op(
        "mslk_selftest::scaled_by_name(Tensor x, Tensor scale, float factor=2.0, bool twice=False) -> Tensor",
        domain="selftest",
        reference=lambda a, b, f=2.0, t=False: a * b[:, None] * f * (2 if t else 1),
        fake=lambda x, scale, factor=2.0, twice=False: torch.empty_like(x),
    )
    x, s = testing.randn(4, 6), testing.randn(4)
    want = x * s[:, None] * 4.0
    assert torch.equal(op(x=x, scale=s, twice=True, backend="reference"), want)
    assert torch.equal(op(x, scale=s, factor=4.0, backend="reference"), want)
    assert torch.equal(op(x, s, backend="reference"), x * s[:, None] * 2.0)
    with pytest.raises(RuntimeError, match="Argument 'x' specified both as positional and keyword argument"):
        op(x, x=x, scale=s, backend="reference")
    with pytest.raises(RuntimeError, match="missing value for argument 'scale'"):
        op(x=x, factor=1.0, backend="reference")


def test_a_pinned_call_pins_that_op_alone_and_refuses_gradients_as_others(fresh_ops):
    """`op(..., backend=NAME)` ran the backend outside torch.ops: gradients of the reference's torch ops flowed where
    the op has no backward. Ops that the pinned backend calls are dispatched as usual."""
    inner = fresh_ops()
    outer = registry.Op(
        f"mslk_selftest::calls_another_{id(inner)}(Tensor x, Tensor scale) -> Tensor",
        domain="selftest",
        reference=lambda x, scale: inner(x, scale),
        fake=lambda x, scale: torch.empty_like(x),
    )
    outer.backend("cpu_kernel", devices=("cpu",))(lambda x, scale: inner(x, scale) * 2)
    x, scale = _inputs()
    assert torch.equal(outer(x, scale, backend="cpu_kernel"), inner(x, scale) * 2)  # inner: not pinned to cpu_kernel
    assert torch.equal(outer(x, scale, backend="reference"), inner(x, scale))
    result = inner(x.clone().requires_grad_(), scale, backend="reference")
    with pytest.raises(RuntimeError, match=f"{inner.qualname} has no backward"):
        result.float().sum().backward()


def test_pinned_backend_that_cannot_serve_raises_value_error(fresh_ops, monkeypatch):
    op = fresh_ops(devices=("cpu",))
    monkeypatch.setenv("MSLK_BACKEND", "triton")
    x = testing.randn(2, 3, 4)
    with pytest.raises(ValueError) as info:
        op(x, testing.randn(2))
    text = str(info.value)
    assert text.startswith(f"Operator `{op.qualname}` does not support inputs:")
    assert "`triton` is not supported because:\n    x.dim() == 3 (supported: 2)" in text
    assert not isinstance(info.value, NotSupportedError)


def test_unknown_pinned_backend(fresh_ops):
    op = fresh_ops()
    with pytest.raises(ValueError, match="has no backend 'cutlass'"):
        op(*_inputs(), backend="cutlass")


def test_unavailable_backend_reason_is_cached_and_reported(fresh_ops):
    calls = []

    def available():
        calls.append(1)
        return "native library libmslk_gemm.so not loaded"

    op = fresh_ops(devices=("cpu",), available=available)
    x, s = _inputs()
    assert op.select((x, s), {}).name == "reference"
    assert op.select((x, s), {}).name == "reference"
    assert calls == [1]
    assert [b.name for b in op.usable_backends("cpu")] == ["reference"]
    with pytest.raises(ValueError, match=r"libmslk_gemm\.so not loaded"):
        op(x, s, backend="triton")


def test_a_backend_requirement_is_asked_of_the_first_tensor(fresh_ops):
    """`requires` says why the GPU holding the call's first tensor cannot run a backend (arch.fp8_e4m3_missing):
    the dispatcher passes over it, a pinned call raises with the reason."""
    asked = []

    def requires(t):
        asked.append(t)
        return "this GPU is too old"

    op = fresh_ops(devices=("cpu",))
    op.backends[0].requires = requires
    x, s = _inputs()
    assert op.select((x, s), {}).name == "reference"
    assert asked == [x]
    with pytest.raises(ValueError, match=r"`triton` is not supported because:\n +this GPU is too old"):
        op(x, s, backend="triton")
    op.backends[0].requires = lambda t: None
    assert op.select((x, s), {}).name == "triton"


def test_log_dispatch(fresh_ops, monkeypatch, caplog):
    op = fresh_ops()
    monkeypatch.setenv("MSLK_LOG_DISPATCH", "1")
    with caplog.at_level(logging.INFO, logger="mslk.dispatch"):
        op(*_inputs())
    assert f"{op.qualname} -> reference" in caplog.text


def test_duplicate_definitions_are_refused(fresh_ops):
    op = fresh_ops()
    with pytest.raises(ValueError, match="already has a backend"):
        op.backend("triton")(lambda x, s: x)
    with pytest.raises(ValueError, match="defined twice"):
        registry.Op(f"{op.qualname}(Tensor x, Tensor scale) -> Tensor", domain="t", reference=op.reference)
    with pytest.raises(ValueError, match="needs a namespace"):
        registry.Op("nonamespace(Tensor x) -> Tensor", domain="t", reference=lambda x: x)


def test_get_by_name(fresh_ops):
    op = fresh_ops()
    assert registry.get(op.qualname) is op
    with pytest.raises(KeyError, match="is its domain package installed"):
        registry.get("f8f8bf16_nonexistent")


def test_opcheck_conformance(fresh_ops):
    testing.run_opcheck(fresh_ops())


def test_opcheck_catches_a_wrong_fake(fresh_ops):
    op = fresh_ops(fake=lambda x, scale: x.new_empty(x.shape[0]))
    with pytest.raises(Exception, match=r"(?i)shape|size"):
        testing.run_opcheck(op)


def test_check_against_reference_catches_wrong_kernel_and_fake(fresh_ops):
    good = fresh_ops()
    assert [p for s in good.samples(torch.device("cpu")) for p in testing.check_against_reference(good, s)] == []
    wrong_fake = fresh_ops(fake=lambda x, scale: x.new_empty(x.shape[0], 1))
    sample = next(iter(wrong_fake.samples(torch.device("cpu"))))
    problems = testing.check_against_reference(wrong_fake, sample)
    assert any("the fake kernel says (3, 1)" in p for p in problems)


def test_check_against_reference_compares_what_the_op_writes_into(fresh_add_into_op):
    for factor, wrong in [(1.0, False), (2.0, True)]:
        op = fresh_add_into_op(factor)
        sample = next(iter(op.samples(torch.device("cpu"))))
        before = sample.args[0].clone()
        problems = testing.check_against_reference(op, sample)
        assert bool(problems) == wrong, problems
        assert torch.equal(sample.args[0], before), "the check works on copies of the sample"


def test_layout_problems_catch_a_kernel_that_ignores_strides(fresh_ops):
    def contiguous_only(x, scale):  # reads x's storage as a contiguous matrix
        return (torch.as_strided(x, x.shape, (x.shape[1], 1)).float() * scale[:, None]).to(x.dtype)

    def refuse_strided(x, scale):
        if not x.is_contiguous():
            raise ValueError("x must be contiguous")

    wrong = fresh_ops(reference=contiguous_only)
    sample = next(iter(wrong.samples(torch.device("cpu"))))
    problems = testing.layout_problems(wrong, sample)
    assert any("x in padded rows: output 0: relative error" in p for p in problems), problems
    assert any("x in column-major" in p for p in problems), problems
    assert testing.layout_problems(fresh_ops(reference=contiguous_only, validate=refuse_strided), sample) == []
    assert testing.layout_problems(fresh_ops(), sample) == []


def test_layout_problems_catch_a_fake_kernel_with_other_strides(fresh_ops):
    """torch.compile lays out the code around an op by its fake kernel: the real outputs must have its strides too,
    whatever the inputs' layouts (here the reference keeps a column-major x's layout, the fake says contiguous)."""
    wrong = fresh_ops(fake=lambda x, scale: x.new_empty(x.shape))
    sample = next(iter(wrong.samples(torch.device("cpu"))))
    assert [p for p in testing.check_against_reference(wrong, sample)] == []  # (contiguous inputs: alike)
    problems = testing.layout_problems(wrong, sample)
    assert len(problems) == 1 and "x in column-major: AssertionError: output 0: the fake kernel says" in problems[0]
    assert "strides (5, 1), the kernel gives (3, 5) torch.bfloat16 strides (1, 3)" in problems[0], problems


@pytest.mark.skipif(not testing.interpreting(), reason="runs the Triton kernel on CPU (TRITON_INTERPRET=1)")
def test_triton_layout_problems_compare_the_kernel_with_the_fake(fresh_ops):
    triton = registry.triton_missing  # (how triton_layout_problems knows a Triton backend)
    column_major = fresh_ops(fake=lambda x, scale: x.mT.contiguous().mT, available=triton)  # the kernel writes rows
    sample = next(iter(column_major.samples(torch.device("cpu"))))
    problems = testing.triton_layout_problems(column_major, sample)
    assert len(problems) == 1 and "triton: output 0: the fake kernel says" in problems[0], problems
    assert testing.triton_layout_problems(fresh_ops(available=triton), sample) == []


def test_device_mixing_problems(fresh_ops):
    op = fresh_ops()
    sample = next(iter(op.samples(torch.device("cpu"))))
    problems = testing.device_mixing_problems(op, sample, "meta")
    assert len(problems) == 2 and all("on meta" in p for p in problems), problems

    def same_device(x, scale):
        registry.check_devices("scale_rows", x=x, scale=scale)

    assert testing.device_mixing_problems(fresh_ops(validate=same_device), sample, "meta") == []


def test_interpreted_triton_backend_matches_reference(fresh_ops):
    """Tier T1: the Triton kernel itself (interpreter on CPU, compiled on a GPU) against the reference."""
    op = fresh_ops()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for rows, cols in [(1, 1), (5, 63), (7, 130)]:
        x = testing.randn(rows, cols, dtype=torch.bfloat16, device=device)
        s = testing.randn(rows, device=device)
        out = op.get_backend("triton").impl(x, s)
        testing.assert_rel_close(out, scale_rows_ref(x, s))
    empty = op.get_backend("triton").impl(torch.empty(0, 5, device=device), torch.empty(0, device=device))
    assert empty.shape == (0, 5)


def test_interpreted_backend_handles_padded_rows(fresh_ops):
    op = fresh_ops()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = testing.padded_rows(testing.randn(6, 70, dtype=torch.bfloat16, device=device))
    assert not x.is_contiguous()
    s = testing.randn(6, device=device)
    testing.assert_rel_close(op.get_backend("triton").impl(x, s), scale_rows_ref(x, s))


def scale_rows_ref(x, s):
    return (x.double().cpu() * s.double().cpu()[:, None]).to(x.dtype)


def test_validate_runs_before_backends_and_in_the_fake(fresh_ops):
    def validate(x, scale):
        if scale.dtype != torch.float32:
            raise ValueError("scale must be float32")

    op = registry.Op(
        "mslk_selftest::validated(Tensor x, Tensor scale) -> Tensor",
        domain="selftest",
        reference=lambda x, scale: x * scale[:, None],
        fake=lambda x, scale: torch.empty_like(x),
        validate=validate,
    )
    x = testing.randn(2, 3)
    with pytest.raises(ValueError, match="scale must be float32"):
        op(x, testing.randn(2, dtype=torch.float64))
    with torch._subclasses.fake_tensor.FakeTensorMode(), pytest.raises(ValueError, match="scale must be float32"):
        op(torch.empty(2, 3), torch.empty(2, dtype=torch.float64))
    s = testing.randn(2)
    testing.assert_rel_close(op(x, s), x * s[:, None])


def test_none_for_a_required_tensor_is_named(fresh_ops):
    """torch lets None through to a Tensor argument: the op names it before its validation (which would fail on
    None.dtype) and the fake run; an optional tensor may be None."""
    op = registry.Op(
        "mslk_selftest::scaled(Tensor x, Tensor scale, Tensor? bias=None) -> Tensor",
        domain="selftest",
        reference=lambda x, scale, bias=None: x * scale,
        fake=lambda x, scale, bias=None: torch.empty_like(x),
        validate=lambda x, scale, bias=None: scale.dtype,
    )
    x = testing.randn(3)
    for call in (lambda: op(x, None), lambda: op(x, scale=None), lambda: op(x, None, x)):
        with pytest.raises(ValueError, match="scaled: scale must be a tensor, got None"):
            call()
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode, pytest.raises(ValueError, match="scale must be"):
        op(mode.from_tensor(x), None)
    testing.assert_rel_close(op(x, x), x * x)


def test_a_call_without_tensors_gets_the_validation_error(fresh_ops):
    """Empty lists and None optionals leave the dispatcher no device: the op's validation speaks, not torch's
    "no fallback function is registered"."""

    def validate(xs, y):
        if not xs:
            raise ValueError("list_sum: needs at least one tensor")

    op = registry.Op(
        "mslk_selftest::list_sum(Tensor[] xs, Tensor? y) -> Tensor",
        domain="selftest",
        reference=lambda xs, y: sum(xs),
        validate=validate,
    )
    with pytest.raises(ValueError, match="list_sum: needs at least one tensor"):
        op([], None)
    x = testing.randn(3)
    testing.assert_rel_close(op([x, x], None), 2 * x)


def test_an_op_that_returns_its_output_argument(fresh_ops):
    """out_arg: the op returns `output` itself when given, a new tensor otherwise, through two hidden ops, so that
    opcheck finds no undeclared alias and Inductor compiles calls without the argument (it failed on
    `Tensor(a!)? output=None` left None: "getitem is not an OpOverload")."""

    def reference(x, scale, output=None):
        result = (x.float() * scale[:, None]).to(x.dtype)
        return result if output is None else output.copy_(result)

    def samples(device):
        x, scale = testing.randn(3, 5, device=device), testing.randn(3, device=device)
        yield registry.Sample((x, scale))
        yield registry.Sample((x, scale, testing.empty_poisoned(3, 5, dtype=x.dtype, device=device)))

    op = registry.Op(
        f"mslk_selftest::scale_rows_into_{id(samples)}(Tensor x, Tensor scale, Tensor(a!)? output=None) -> Tensor",
        domain="selftest",
        reference=reference,
        fake=lambda x, scale, output=None: torch.empty_like(x) if output is None else output,
        samples=samples,
        out_arg="output",
    )
    x, scale = testing.randn(4, 6), testing.randn(4)
    expected = reference(x, scale)
    assert torch.equal(op(x, scale), expected)
    output = testing.empty_poisoned(4, 6, dtype=x.dtype)
    assert op(x, scale, output=output) is output and torch.equal(output, expected)
    testing.run_opcheck(op)
    for given in (False, True):
        torch._dynamo.reset()
        call = (lambda x, s: op.torch_op(x, s, output)) if given else (lambda x, s: op.torch_op(x, s))
        assert torch.equal(torch.compile(call, fullgraph=True, backend="inductor")(x, scale), expected)
    # An output whose elements share memory is refused before a backend runs (one write of several would win).
    padded = testing.empty_poisoned(4, 8, dtype=x.dtype)[:, :6]
    assert op(x, scale, output=padded) is padded and torch.equal(padded, expected), "gaps are no overlap"
    for shared in (
        torch.empty(4, 1).expand(4, 6),
        torch.empty(6).expand(4, 6),
        torch.empty(30).as_strided((4, 6), (3, 1)),
    ):
        with pytest.raises(ValueError, match="output is written, but its elements overlap in memory"):
            op(x, scale, output=shared)


def test_a_required_output_argument_of_none_is_named(fresh_ops):
    """out_arg not optional (`Tensor(a!) output`): None gets the op's error (the composite called a missing
    functional op: "'NoneType' object is not callable")."""
    op = registry.Op(
        "mslk_selftest::copy_into(Tensor x, Tensor(a!) output) -> Tensor",
        domain="selftest",
        reference=lambda x, output: output.copy_(x),
        out_arg="output",
    )
    x = testing.randn(3)
    with pytest.raises(ValueError, match="copy_into: output must be a tensor, got None"):
        op(x, None)
    output = testing.empty_poisoned(3, dtype=x.dtype)
    assert op(x, output) is output and torch.equal(output, x)


def test_check_output():
    cpu = torch.device("cpu")
    registry.check_output("op", "out", None, (2, 3), (torch.float32,), cpu)  # none given: nothing to check
    registry.check_output("op", "out", torch.empty(2, 3, dtype=torch.bfloat16), (2, 3), (torch.bfloat16,), cpu)
    bad = [
        (torch.empty(3, 2), r"op: out must be float32 or bfloat16 \(2, 3\) on cpu, got \(3, 2\) torch.float32 on cpu"),
        (torch.empty(2, 3, dtype=torch.float16), r"got \(2, 3\) torch.float16"),
        (torch.empty(2, 3, device="meta"), r"on cpu, got \(2, 3\) torch.float32 on meta"),
    ]
    for out, message in bad:
        with pytest.raises(ValueError, match=message):
            registry.check_output("op", "out", out, (2, 3), (torch.float32, torch.bfloat16, torch.float32), cpu)


def test_check_writable():
    for t in (torch.empty(3, 4), torch.empty(3, 4).t(), torch.empty(2, 3, 4).permute(2, 0, 1), torch.empty(5, 1, 0)):
        registry.check_writable("op", "out", t)
    registry.check_writable("op", "out", torch.empty(1).expand(1, 1, 1))  # one element
    for t in (torch.empty(3).expand(2, 3), torch.empty(8).as_strided((3, 3), (2, 1))):
        with pytest.raises(ValueError, match="op: out is written, but its elements overlap"):
            registry.check_writable("op", "out", t)


def test_the_fake_refuses_an_overlapping_output_as_the_real_call_does(fresh_add_into_op):
    """torch.compile traces the fake: an expanded output it accepted, the real call refused."""
    op = fresh_add_into_op(1.0)
    out, x = torch.zeros(4).expand(3, 4), testing.randn(3, 4)
    with pytest.raises(ValueError, match="out is written, but its elements overlap"):
        op(out, x)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake_out, fake_x = mode.from_tensor(out), mode.from_tensor(x)
        with pytest.raises(ValueError, match="out is written, but its elements overlap"):
            op(fake_out, fake_x)


def test_an_op_without_a_backward_refuses_to_differentiate_eagerly_and_compiled(fresh_ops):
    """Its inputs' gradients were None: silently compiled, with torch's warning eagerly (and on CPU, gradients of
    the reference's torch ops, which no GPU kernel gives)."""
    op = fresh_ops()
    x, scale = _inputs()
    expected = op(x, scale)
    refusal = f"{op.qualname} has no backward, and an input of it requires grad"
    for needing in ((x,), (scale,), (x, scale)):
        args = [t.clone().requires_grad_(any(t is n for n in needing)) for t in (x, scale)]
        for name, call in (("eager", op.torch_op), ("compiled", torch.compile(op.torch_op, backend="aot_eager"))):
            torch._dynamo.reset()
            result = call(*args)
            assert torch.equal(result, expected) and result.requires_grad, name
            with pytest.raises(RuntimeError, match=refusal):
                result.float().sum().backward()
    with torch.no_grad():
        assert not op(x.requires_grad_(), scale).requires_grad


def test_gradient_problems_catch_an_op_whose_backward_runs(fresh_ops, monkeypatch):
    monkeypatch.setattr(registry, "_register_no_backward", lambda *args: None)
    op = fresh_ops()
    sample = next(iter(op.samples(torch.device("cpu"))))
    with pytest.warns(UserWarning, match="an autograd kernel was not registered"):
        assert testing.gradient_problems(op, sample) == [f"{op.name}: its backward ran"]


def test_an_op_that_writes_refuses_inputs_that_require_grad(fresh_add_into_op):
    op = fresh_add_into_op(1.0)
    out, x = testing.randn(3, 4), testing.randn(3, 4)
    with pytest.raises(RuntimeError, match=f"{op.qualname} writes into out and has no backward, but x requires grad"):
        op(out, x.clone().requires_grad_())
    with torch.no_grad():
        op(out, x.clone().requires_grad_())
    for sample in op.samples(torch.device("cpu")):
        assert testing.gradient_problems(op, sample) == []


def test_a_declared_backward(fresh_ops):
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad * scale[:, None], None

    op = registry.Op(
        f"mslk_selftest::scale_rows_differentiable_{id(backward)}(Tensor x, Tensor scale) -> Tensor",
        domain="selftest",
        reference=lambda x, scale: x * scale[:, None],
        fake=lambda x, scale: torch.empty_like(x),
        backward=backward,
        setup_context=setup_context,
    )
    x, scale = testing.randn(4, 6, dtype=torch.float64).requires_grad_(), testing.randn(4, dtype=torch.float64)
    op(x, scale).sum().backward()
    assert op.differentiable and torch.equal(x.grad, scale[:, None].expand(4, 6))
    with pytest.raises(ValueError, match="an op with out_arg has no backward"):
        registry.Op(
            f"mslk_selftest::scale_rows_into_{id(backward)}(Tensor x, Tensor(a!)? out=None) -> Tensor",
            domain="selftest",
            reference=lambda x, out=None: x,
            out_arg="out",
            backward=backward,
        )


def test_a_dual_tensor_is_refused(fresh_ops):
    """Forward-mode AD: the kernels ran on the primal and the result came back without a tangent, silently."""
    import torch.autograd.forward_ad as forward_ad

    op = fresh_ops()
    x, scale = _inputs()
    with forward_ad.dual_level():
        with pytest.raises(RuntimeError, match=f"{op.qualname} has no forward-mode derivative"):
            op(forward_ad.make_dual(x, testing.randn(*x.shape, dtype=x.dtype)), scale)
        assert torch.equal(op(x, scale), (x.float() * scale[:, None]).to(x.dtype))  # plain tensors, as before
