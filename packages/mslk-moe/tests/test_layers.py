"""MoE layers (spec M-11..M-13) on one rank: MetaShufflingMoE and BaselineMoE against a naive per-token,
per-expert loop in float64; parameter layouts, initialisation, sharding and argument errors.
test_layers_distributed.py runs the expert- and tensor-parallel paths on several ranks."""

import copy
import math
import pickle

import pytest
import torch

from mslk.core import arch, testing
from mslk.moe import layers
from mslk.moe.layers import (
    BaselineMoE,
    MetaShufflingMoE,
    MoEArgs,
    RoutedExperts,
    ScaledParameter,
    SharedExperts,
    init_params,
    param_shapes,
    sharded_init_methods,
)

D, HIDDEN = 64, 96
BF16_TOL = 2e-2  # against float64: bf16 inputs, weights and intermediates
# Against the float64 unquantized model, four rowwise FP8 quantizations compound: 6% on average, and on a single
# token (64 values) 12.5% at worst over 2000 draws.
FP8_TOL = 0.15
# The two layers' FP8 paths run different GEMMs, whose bf16 outputs may differ by an ulp; the activations' FP8
# quantization can turn that into a whole e4m3 step (12.5%) of a value: on a single token (64 values) 2.8% was
# seen on the GPU.
FP8_VS_BASELINE_TOL = 5e-2


def full_weights(args: MoEArgs, device="cpu") -> dict[str, torch.Tensor]:
    """Random bf16 full (unsharded) weights, std 1/sqrt(fan_in): outputs of order one."""
    fan_in = {key: args.hidden_dim if "out" in key else args.dim for key in param_shapes(args)}
    return {
        key: testing.randn(*shape, dtype=torch.bfloat16, device=device, std=fan_in[key] ** -0.5)
        for key, shape in param_shapes(args).items()
    }


def build(cls, args: MoEArgs, full, device="cpu", ep_group=None, mp_group=None, ep_rank=0, mp_rank=0):
    with torch.device(device):
        return cls(ep_group, mp_group, args).build(sharded_init_methods(full, args, ep_rank, mp_rank))


def naive_moe(x: torch.Tensor, full: dict[str, torch.Tensor], top_k: int) -> torch.Tensor:
    """x [N, D] -> [N, D] in float64, token by token and expert by expert, from the module docstring's math."""
    x = x.double().cpu()
    w = {key: value.double().cpu() for key, value in full.items()}
    scores = torch.sigmoid(x @ w["router_DE"])

    def swiglu(v, w_in, w_swiglu, w_out):
        return (torch.nn.functional.silu(v @ w_in) * (v @ w_swiglu)) @ w_out

    out = torch.empty_like(x)
    for n in range(x.shape[0]):
        out[n] = swiglu(x[n], w["w_in_shared_FD"].T, w["w_swiglu_FD"].T, w["w_out_shared_DF"].T)
        for e in torch.sort(scores[n], descending=True, stable=True).indices[:top_k].tolist():  # ties: lower e
            v = x[n] * scores[n, e]
            out[n] += swiglu(v, w["moe_w_in_eDF"][e], w["moe_w_swiglu_eDF"][e], w["moe_w_out_eFD"][e])
    return out


def every_path(model: MetaShufflingMoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward (both use_static_shape values) and, on one rank, the two EP paths called directly: their
    regrouping (combine/split_shuffling, padded slabs, split sizes) runs with the all-to-all an identity."""
    tokens = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        return {
            "forward(static)": model(x, use_static_shape=True),
            "forward(dynamic)": model(x, use_static_shape=False),
            "_static_comm_forward": model._static_comm_forward(tokens).view(x.shape),
            "_dynamic_comm_forward": model._dynamic_comm_forward(tokens).view(x.shape),
        }


def check_against_naive(precision: str, experts: int, top_k: int, batch: int, seq: int, device: str) -> None:
    args = MoEArgs(precision, D, HIDDEN, experts, top_k)
    full = full_weights(args, device)
    baseline = build(BaselineMoE, args, full, device)
    shuffling = build(MetaShufflingMoE, args, full, device)
    x = testing.randn(batch, seq, D, dtype=torch.bfloat16, device=device)
    ref = naive_moe(x.view(-1, D), full, top_k).view(x.shape)
    tol = BF16_TOL if precision == "bf16" else FP8_TOL
    base_out = baseline(x, use_static_shape=False)
    testing.assert_rel_close(base_out, ref, tol, what="BaselineMoE vs naive")
    for path, out in every_path(shuffling, x).items():
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        testing.assert_rel_close(out, ref, tol, what=f"MetaShufflingMoE {path} vs naive")
        testing.assert_rel_close(out, base_out, FP8_VS_BASELINE_TOL, what=f"MetaShufflingMoE {path} vs BaselineMoE")


@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
@pytest.mark.parametrize(("experts", "top_k"), [(1, 1), (4, 1), (4, 2), (8, 3)])
@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (3, 13), (1, 37)])
def test_layers_match_naive_loop(precision, experts, top_k, batch, seq):
    check_against_naive(precision, experts, top_k, batch, seq, "cpu")


@pytest.mark.parametrize("top_k", [1, 2])
def test_tied_scores_route_to_the_lower_experts(top_k):
    """A saturated router (every score 1.0): both layers route as index_shuffling breaks ties, to the experts of
    the lowest numbers (BaselineMoE's torch.topk picked others: 3.3x the output's norm apart)."""
    args = MoEArgs("bf16", D, HIDDEN, 4, top_k)
    full = full_weights(args)
    full["router_DE"] = torch.full_like(full["router_DE"], 10.0)
    x = testing.randn(2, 3, D, dtype=torch.bfloat16).abs() + 1  # scores sigmoid(10 · Σx) = 1 in fp32 and fp64
    ref = naive_moe(x.view(-1, D), full, top_k).view(x.shape)
    for cls in (BaselineMoE, MetaShufflingMoE):
        with torch.no_grad():
            out = build(cls, args, full)(x, use_static_shape=False)
        testing.assert_rel_close(out, ref, BF16_TOL, what=cls.__name__)


@pytest.mark.gpu
@testing.skipUnlessCuda()
@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
@pytest.mark.parametrize(("experts", "top_k"), [(1, 1), (8, 2), (16, 4)])
@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (3, 13), (2, 301)])
def test_layers_match_naive_loop_gpu(precision, experts, top_k, batch, seq):
    """On CUDA the experts' GEMMs run torch._grouped_mm (bf16) or torch._scaled_grouped_mm (FP8, SM90/SM100)."""
    check_against_naive(precision, experts, top_k, batch, seq, "cuda")


@pytest.mark.gpu
@testing.skipUnlessCuda()
@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
def test_grouped_matmul_gpu_matches_loop(precision):
    """The torch grouped GEMMs against the fallback loop on CPU (empty groups included), and without any host
    sync (CUDA sync debug mode "error", which does catch the loop's read of the offsets): they ran, not the loop."""
    from mslk.quantize.triton.fp8_quantize import quantize_fp8_row

    if precision == "fp8_rowwise" and arch.capability() not in ((9, 0), (10, 0)):
        pytest.skip("torch._scaled_grouped_mm needs SM90 or SM100")
    counts = torch.tensor([5, 0, 17, 1, 0, 40], dtype=torch.int32, device="cuda")
    offsets = layers._offsets(counts)

    def operands(k):  # K = 100: rows of 200 bytes in bf16, not a multiple of 16: the loop's case
        x = testing.randn(int(counts.sum()), k, dtype=torch.bfloat16, device="cuda")
        w = testing.randn(6, 96, k, dtype=torch.bfloat16, device="cuda")
        if precision == "bf16":
            return x, w, offsets
        (xq, x_scale), (wq, w_scale) = quantize_fp8_row(x), quantize_fp8_row(w)
        return xq, wq, offsets, x_scale, w_scale

    fast, loop = operands(128), operands(100)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layers._grouped_matmul(*fast)
        with pytest.raises(RuntimeError, match="synchroniz"):
            layers._grouped_matmul(*loop)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = layers._grouped_matmul(*(a.cpu() for a in fast))
    testing.assert_rel_close(out.cpu(), expected, 1e-2, what=f"{precision} grouped GEMM")


@pytest.mark.gpu
@testing.skipUnlessCuda()
@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
def test_no_comm_and_static_paths_do_not_sync_gpu(precision):
    """use_static_shape promises no host sync (CUDA-graph friendly); with one rank the all-to-all is the
    identity, so this checks everything else. Warm up first: Triton compiles and autotunes on first use."""
    args = MoEArgs(precision, 128, 256, 16, 2)
    model = build(MetaShufflingMoE, args, full_weights(args, "cuda"), "cuda")
    x = testing.randn(2, 33, 128, dtype=torch.bfloat16, device="cuda")
    expected = model(x, use_static_shape=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            outs = [model(x, use_static_shape=True), model._static_comm_forward(x.view(-1, 128))]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for out in outs:
        testing.assert_rel_close(out.view(x.shape), expected, 1e-2)


def check_compiled(cls, precision: str, device: str, static: bool) -> None:
    """The layer compiled whole (fullgraph) gives the eager output (building a ScaledParameter from the weights
    in the forward made Dynamo break the graph)."""
    args = MoEArgs(precision, D, HIDDEN, 4, 2)
    model = build(cls, args, full_weights(args, device), device)
    x = testing.randn(2, 7, D, dtype=torch.bfloat16, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        testing.assert_rel_close(compiled(x, use_static_shape=static), model(x, use_static_shape=static), 1e-2)


@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
def test_baseline_compiles_whole(precision):
    check_compiled(BaselineMoE, precision, "cpu", static=False)


@pytest.mark.gpu
@testing.skipUnlessCuda()
@pytest.mark.parametrize("cls", [BaselineMoE, MetaShufflingMoE])
@pytest.mark.parametrize("precision", ["bf16", "fp8_rowwise"])
def test_layers_compile_whole_gpu(cls, precision):
    check_compiled(cls, precision, "cuda", static=True)


# ---------------------------------------------------------------------------------------- parameters


def test_expert_weights_have_the_spec_layout():
    args = MoEArgs("bf16", D, HIDDEN, 4, 1)
    full = full_weights(args)
    model = build(BaselineMoE, args, full)
    routed, shared = model.routed_experts, model.shared_experts
    assert torch.equal(routed.w13.weights, torch.cat([full["moe_w_in_eDF"], full["moe_w_swiglu_eDF"]], 2).mT)
    assert torch.equal(routed.w2.weights, full["moe_w_out_eFD"].mT)
    assert torch.equal(shared.w13.weights, torch.cat([full["w_in_shared_FD"], full["w_swiglu_FD"]], 0))
    assert torch.equal(shared.w2.weights, full["w_out_shared_DF"])
    assert torch.equal(model.router_DE, full["router_DE"])
    assert isinstance(routed.w13, ScaledParameter) and not routed.w13.is_scaled and routed.w13.scales is None
    assert not routed.is_fp8_rowwise and not routed.w13.requires_grad


@pytest.mark.parametrize("scale", [None, torch.rand(3)], ids=["unscaled", "scaled"])
def test_scaled_parameter_copies_and_pickles(scale):
    """Copies and pickles are ScaledParameters with the same weights and scales (Parameter's own rebuild put
    requires_grad in the scale, or gave a plain Parameter back)."""
    param = ScaledParameter(testing.randn(3, 4), scale)
    for copied in (copy.deepcopy(param), pickle.loads(pickle.dumps(param))):
        assert type(copied) is ScaledParameter and not copied.requires_grad
        assert torch.equal(copied.weights, param.weights) and copied.is_scaled == param.is_scaled
        assert scale is None or (torch.equal(copied.scales, scale) and copied.scales is not scale)


def test_fp8_weights_are_rowwise_quantized_and_travel_with_the_module():
    args = MoEArgs("fp8_rowwise", D, HIDDEN, 4, 2)
    full = full_weights(args)
    model = build(MetaShufflingMoE, args, full)
    routed = model.routed_experts
    assert routed.is_fp8_rowwise and model.shared_experts.is_fp8_rowwise
    w13 = routed.w13
    assert w13.is_scaled and w13.weights.dtype == torch.float8_e4m3fn
    assert w13.weights.shape == (4, 2 * HIDDEN, D) and w13.scales.shape == (4, 2 * HIDDEN)
    assert w13.scales.dtype == torch.float32 and model.shared_experts.w2.scales.shape == (D,)
    dequantized = w13.weights.float() * w13.scales[..., None]
    bf16 = torch.cat([full["moe_w_in_eDF"], full["moe_w_swiglu_eDF"]], 2).mT
    testing.assert_rel_close(dequantized, bf16, 5e-2, what="dequantized w13")
    state = model.state_dict()
    assert {"routed_experts.w13_weight", "routed_experts.w13_scale", "shared_experts.w2_scale"} <= set(state)
    # Module.to() moves weights and scales together (the scales are buffers, read into ScaledParameter on access).
    model.to("meta")
    assert model.routed_experts.w13.weights.is_meta and model.routed_experts.w13.scales.is_meta


def test_default_init_is_seeded_scaled_and_leaves_the_global_rng_alone():
    args = MoEArgs("bf16", D, HIDDEN, 4, 2)
    rng = torch.get_rng_state()
    first = MetaShufflingMoE(None, None, args).build()
    assert torch.equal(torch.get_rng_state(), rng)
    torch.manual_seed(1234)
    second = MetaShufflingMoE(None, None, args).build()
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    w_in = first.routed_experts.w13.weights[:, :HIDDEN].float()  # fan-in D
    w_out = first.routed_experts.w2.weights.float()  # fan-in HIDDEN
    assert math.isclose(w_in.std().item(), D**-0.5, rel_tol=0.1)
    assert math.isclose(w_out.std().item(), HIDDEN**-0.5, rel_tol=0.1)
    out = first(testing.randn(2, 9, D, dtype=torch.bfloat16), use_static_shape=False)
    assert 0.05 < out.float().std().item() < 20, "outputs of order one"


def test_init_methods_fill_in_place():
    calls = []

    def fill(t):
        calls.append(tuple(t.shape))
        t.fill_(0.5)

    experts = RoutedExperts(3, 16, 8).build({"moe_w_in_eDF": fill})
    assert calls == [(3, 16, 8)]
    assert torch.all(experts.w13.weights[:, :8] == 0.5) and not torch.all(experts.w13.weights[:, 8:] == 0.5)
    t = torch.empty(8, 16)
    init_params("w_in_shared_FD", t, {"w_in_shared_FD": lambda p: p.fill_(2.0)})
    assert torch.all(t == 2.0)
    assert SharedExperts(16, 8).build().w13.shape == (16, 16)


def test_sharded_init_methods_tile_the_full_weights():
    args = MoEArgs("bf16", 32, 48, 4, 1, mp_size=2, ep_size=2)
    full = full_weights(args)
    local_shapes = {  # EP halves the experts (e), TP the hidden dim (F); the router is replicated
        key: [n // 2 if d in "eF" else n for d, n in zip(layers._dims(key), shape, strict=True)]
        for key, shape in param_shapes(args).items()
    }
    shards = {}
    for ep_rank in range(2):
        for mp_rank in range(2):
            methods = sharded_init_methods(full, args, ep_rank, mp_rank)
            shards[ep_rank, mp_rank] = {key: methods[key](torch.empty(local_shapes[key])) for key in full}
    assert all(torch.equal(s["router_DE"], full["router_DE"]) for s in shards.values())
    routed_in = torch.cat([torch.cat([shards[e, m]["moe_w_in_eDF"] for m in range(2)], 2) for e in range(2)], 0)
    routed_out = torch.cat([torch.cat([shards[e, m]["moe_w_out_eFD"] for m in range(2)], 1) for e in range(2)], 0)
    assert torch.equal(routed_in, full["moe_w_in_eDF"]) and torch.equal(routed_out, full["moe_w_out_eFD"])
    assert torch.equal(shards[1, 0]["w_in_shared_FD"], shards[0, 0]["w_in_shared_FD"])
    assert torch.equal(torch.cat([shards[0, m]["w_out_shared_DF"] for m in range(2)], 1), full["w_out_shared_DF"])


# --------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"precision": "fp16"}, "precision must be one of"),
        ({"dim": 0}, "dim must be a positive int"),
        ({"top_k": 0}, "top_k must be a positive int"),
        ({"top_k": 9}, r"top_k must be in \[1, num_experts=8\]"),
        ({"ep_size": 3}, "num_experts=8 must be divisible by ep_size=3"),
        ({"mp_size": 5}, "hidden_dim=96 must be divisible by mp_size=5"),
        ({"mp_size_for_routed_experts": 7}, "hidden_dim=96 must be divisible by mp_size_for_routed_experts=7"),
        ({"mp_size_for_routed_experts": 0}, "mp_size_for_routed_experts must be a positive int"),
        ({"ep_size": True}, "ep_size must be a positive int"),
        ({"dim": 66, "mp_size": 4, "dedup_comm": True}, "dim=66 must be divisible"),
    ],
)
def test_bad_moe_args(changes, message):
    kwargs = {"precision": "bf16", "dim": D, "hidden_dim": HIDDEN, "num_experts": 8, "top_k": 2, **changes}
    with pytest.raises(ValueError, match=message):
        MoEArgs(**kwargs)


def test_moe_args_derived_sizes():
    args = MoEArgs("bf16", D, HIDDEN, 8, 2, mp_size=4, ep_size=2)
    assert args.num_local_experts == 4 and args.routed_mp_size == 4
    assert MoEArgs("bf16", D, HIDDEN, 8, 2, mp_size=4, mp_size_for_routed_experts=2).routed_mp_size == 2


@pytest.mark.parametrize("cls", [BaselineMoE, MetaShufflingMoE])
def test_bad_layer_arguments(cls):
    with pytest.raises(ValueError, match=r"ep_group has 1 rank\(s\) \(None is one\) but moe_args.ep_size=2"):
        cls(None, None, MoEArgs("bf16", D, HIDDEN, 8, 2, ep_size=2))
    with pytest.raises(ValueError, match="ep_mp_group has 1 rank"):
        cls(None, None, MoEArgs("bf16", D, HIDDEN, 8, 2, mp_size=2))
    with pytest.raises(ValueError, match="mp_size_for_routed_experts=1 must be None or mp_size=2"):
        cls(None, None, MoEArgs("bf16", D, HIDDEN, 8, 2, mp_size=2, mp_size_for_routed_experts=1))
    with pytest.raises(ValueError, match="moe_args must be MoEArgs"):
        cls(None, None, {"dim": D})
    model = cls(None, None, MoEArgs("bf16", D, HIDDEN, 8, 2))
    with pytest.raises(RuntimeError, match="call build"):
        model(testing.randn(1, 3, D, dtype=torch.bfloat16), use_static_shape=False)
    with pytest.raises(ValueError, match="unknown keys"):
        model.build({"router": lambda t: t})
    model.build()
    for shape, dtype in (((3, D), torch.bfloat16), ((1, 3, D), torch.float32), ((1, 3, D + 1), torch.bfloat16)):
        with pytest.raises(ValueError, match=r"x must be bfloat16 \[B, T, D=64\]"):
            model(testing.randn(*shape, dtype=dtype), use_static_shape=False)
    with pytest.raises(ValueError, match="x is on meta but the parameters are on cpu"):
        model(torch.empty(1, 3, D, dtype=torch.bfloat16, device="meta"), use_static_shape=False)


def test_bad_init_arguments():
    args = MoEArgs("bf16", D, HIDDEN, 4, 1, ep_size=2)
    full = full_weights(args)
    with pytest.raises(ValueError, match="unknown key 'w_in'"):
        init_params("w_in", torch.empty(2), {})
    with pytest.raises(ValueError, match="full must have the keys"):
        sharded_init_methods({k: v for k, v in full.items() if k != "router_DE"}, args)
    with pytest.raises(ValueError, match=r"full\['router_DE'\] must be \(64, 4\)"):
        sharded_init_methods({**full, "router_DE": full["router_DE"].t()}, args)
    with pytest.raises(ValueError, match="0 <= ep_rank < 2"):
        sharded_init_methods(full, args, ep_rank=2)
    with pytest.raises(ValueError, match="precision must be one of"):
        SharedExperts(D, HIDDEN).build(precision="int8")
    with pytest.raises(RuntimeError, match="call build"):
        SharedExperts(D, HIDDEN).w13  # noqa: B018
