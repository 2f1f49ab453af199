"""MoE layers (spec M-11..M-13): a Llama-4-style mixture of SwiGLU experts plus a shared expert, with expert
parallelism (EP) and tensor parallelism (TP) over torch.distributed.

For tokens x [N, D] (the B·T tokens of a batch), one layer computes

    scores = sigmoid(x · router_DE)                                   [N, E], fp32
    out[n] = shared(x[n]) + Σ_{e ∈ top_k(scores[n])} expert_e(x[n] · scores[n, e])
    expert(v) = (silu(v · W_in) ⊙ (v · W_swiglu)) · W_out             (SwiGLU; the shared expert too)

so each routed expert sees its token scaled by its score. `BaselineMoE` computes this densely (every expert on
every token, masked, with bmm): simple and obviously right. `MetaShufflingMoE` computes the same through the
MetaShuffling pipeline of spec §8 (index_shuffling, gather_scale(_quant)_dense_tokens, grouped GEMM, silu_mul
(_quant), grouped GEMM, scatter_add_dense_tokens; combine_shuffling / split_shuffling around the exchange of EP,
and scatter_add_padded_tokens after its fixed-size form).

Precision "bf16": bf16 weights and activations, fp32 accumulation. "fp8_rowwise": the experts' weights are
stored in this platform's FP8 with one fp32 scale per output row (quantize_fp8_row), and the activations are
quantized rowwise before each expert GEMM; the router stays bf16 (routing in fp32).

Parallelism. `ep_group` holds the EP ranks: each has its own tokens and owns num_experts / ep_size experts
(rank r: experts [r·EG, (r+1)·EG)); tokens travel to their experts' owners and back (all_to_all; with static
shapes all_gather there, all_to_all back).
`ep_mp_group` holds the TP ranks: they have the same tokens, and each holds a 1/mp_size share of the hidden
dim of every local expert, shared expert included; the layer's output is summed over them (all_reduce), so
every rank returns the complete output for its tokens. A group of None is a single rank. The layer computes
nothing the caller must reduce afterwards.
"""

from __future__ import annotations

import copy
import math
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mslk.core import arch
from mslk.moe import parallel
from mslk.moe.activation import silu_mul, silu_mul_quant
from mslk.moe.gather_scatter import (
    gather_scale_dense_tokens,
    gather_scale_quant_dense_tokens,
    scatter_add_dense_tokens,
    scatter_add_padded_tokens,
)
from mslk.moe.shuffling import combine_shuffling, index_shuffling, split_shuffling, top_experts
from mslk.quantize.triton.fp8_quantize import quantize_fp8_row

__all__ = [
    "BaselineMoE",
    "Experts",
    "MetaShufflingMoE",
    "MoEArgs",
    "RoutedExperts",
    "ScaledParameter",
    "SharedExperts",
    "init_params",
    "param_shapes",
    "sharded_init_methods",
]

PRECISIONS = ("bf16", "fp8_rowwise")

# Every parameter (spec M-11 keys) and the dim its matmul contracts over (its fan-in). A key ends with its
# dims: D = dim, E = num_experts (the router's outputs), e = experts (EP shards them), F = hidden_dim (TP shards it).
_FAN_IN = {
    "router_DE": "D",
    "moe_w_in_eDF": "D",
    "moe_w_out_eFD": "F",
    "moe_w_swiglu_eDF": "D",
    "w_in_shared_FD": "D",
    "w_out_shared_DF": "F",
    "w_swiglu_FD": "D",
}


def _dims(key: str) -> str:
    return key.rsplit("_", 1)[1]


InitMethods = Mapping[str, Callable[[torch.Tensor], object]]


@dataclass(frozen=True)
class MoEArgs:
    """The configuration of an MoE layer (spec M-11).

    precision: "bf16" or "fp8_rowwise"; dim D; hidden_dim F of each expert (routed and shared, before TP
    sharding); num_experts E; top_k experts per token; mp_size: TP ranks (size of ep_mp_group); ep_size: EP
    ranks (size of ep_group); mp_size_for_routed_experts: TP ranks of the routed experts (None: mp_size; these
    layers shard routed and shared experts over the same group, so it must equal mp_size there);
    use_fast_accum: FP8 GEMMs may accumulate in lower precision (torch._scaled_grouped_mm's flag);
    dedup_comm: TP ranks, which hold the same tokens, each send 1/mp_size of the columns through the EP
    all-to-all and complete the rows among themselves (all_gather / reduce_scatter), instead of all sending
    whole rows (MetaShufflingMoE; BaselineMoE, the reference, ignores it).
    """

    precision: str
    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    mp_size: int = 1
    ep_size: int = 1
    mp_size_for_routed_experts: int | None = None
    use_fast_accum: bool = False
    dedup_comm: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"MoEArgs: precision must be one of {PRECISIONS}, got {self.precision!r}")
        sizes = ["dim", "hidden_dim", "num_experts", "top_k", "mp_size", "ep_size"]
        if self.mp_size_for_routed_experts is not None:
            sizes.append("mp_size_for_routed_experts")
        for name in sizes:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEArgs: {name} must be a positive int, got {value!r}")
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"MoEArgs: num_experts={self.num_experts} must be divisible by ep_size={self.ep_size} (each EP "
                "rank owns the same number of experts)"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEArgs: top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        for name in ("mp_size", "mp_size_for_routed_experts"):
            if self.hidden_dim % (getattr(self, name) or 1):
                raise ValueError(
                    f"MoEArgs: hidden_dim={self.hidden_dim} must be divisible by {name}={getattr(self, name)} "
                    "(TP shards the experts' hidden dim)"
                )
        if self.dedup_comm and self.dim % self.routed_mp_size:
            raise ValueError(
                f"MoEArgs: with dedup_comm, dim={self.dim} must be divisible by the routed experts' TP size "
                f"{self.routed_mp_size} (each TP rank sends its share of the columns)"
            )

    @property
    def num_local_experts(self) -> int:
        """Experts per EP rank: num_experts // ep_size."""
        return self.num_experts // self.ep_size

    @property
    def routed_mp_size(self) -> int:
        """TP ranks of the routed experts: mp_size_for_routed_experts, or mp_size when that is None."""
        return self.mp_size if self.mp_size_for_routed_experts is None else self.mp_size_for_routed_experts


class ScaledParameter(torch.nn.Parameter):
    """A weight and, when it is stored quantized, its dequantization scales (spec M-11): weights FP8
    [..., N, K] with scales fp32 [..., N] (rowwise: w ≈ weights.float() · scales[..., None]), or weights
    alone (scales None). Never requires grad: the layers are inference only."""

    def __new__(cls, data: torch.Tensor, scale: torch.Tensor | None = None) -> ScaledParameter:
        return super().__new__(cls, data, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        self._scale = scale

    @property
    def weights(self) -> torch.Tensor:
        return self.data

    @property
    def scales(self) -> torch.Tensor | None:
        return self._scale

    @property
    def is_scaled(self) -> bool:
        return self._scale is not None

    # Parameter's own copy and pickling rebuild `type(self)(data, requires_grad)` (the flag landed in `scale`) or a
    # plain Parameter: a ScaledParameter is rebuilt from its weights and scales.
    def __deepcopy__(self, memo: dict) -> ScaledParameter:
        if id(self) not in memo:
            memo[id(self)] = ScaledParameter(copy.deepcopy(self.data, memo), copy.deepcopy(self._scale, memo))
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        return ScaledParameter, (self.data, self._scale)


def _check_init_methods(init_methods: InitMethods) -> None:
    unknown = sorted(set(init_methods) - set(_FAN_IN))
    if unknown:
        raise ValueError(f"init_methods: unknown keys {unknown}; the parameter keys are {list(_FAN_IN)}")


def init_params(key: str, param: torch.Tensor, init_methods: InitMethods | None = None) -> None:
    """Fill `param` (this rank's shard of parameter `key`) in place (spec M-11).

    init_methods[key](param) when given; else a normal draw with std 1/sqrt(fan_in) (fan_in: param's size
    along the dim its matmul contracts over), from a generator seeded by the key alone: the same values on
    every rank and every run, whatever torch's global RNG state. Use init_methods (e.g. sharded_init_methods)
    for real weights.
    """
    if key not in _FAN_IN:
        raise ValueError(f"init_params: unknown key {key!r}; the parameter keys are {list(_FAN_IN)}")
    with torch.no_grad():
        if init_methods is not None and key in init_methods:
            init_methods[key](param.data)
            return
        generator = torch.Generator(device=param.device).manual_seed(zlib.crc32(key.encode()))
        values = torch.randn(param.shape, generator=generator, device=param.device)
        param.data.copy_(values / math.sqrt(param.shape[_dims(key).index(_FAN_IN[key])]))


def param_shapes(moe_args: MoEArgs) -> dict[str, tuple[int, ...]]:
    """The full (unsharded) shape of every parameter key of a layer with these arguments."""
    sizes = {"D": moe_args.dim, "E": moe_args.num_experts, "e": moe_args.num_experts, "F": moe_args.hidden_dim}
    return {key: tuple(sizes[d] for d in _dims(key)) for key in _FAN_IN}


def sharded_init_methods(
    full: Mapping[str, torch.Tensor], moe_args: MoEArgs, ep_rank: int = 0, mp_rank: int = 0
) -> dict[str, Callable[[torch.Tensor], object]]:
    """init_methods that fill each parameter with this rank's shard of the full weights `full` (every key of
    param_shapes(moe_args), at those shapes): experts [ep_rank·EG, (ep_rank+1)·EG) of EP rank ep_rank and the
    hidden-dim block mp_rank of mp_size for TP rank mp_rank. The router is replicated."""
    expected = param_shapes(moe_args)
    if set(full) != set(expected):
        raise ValueError(f"sharded_init_methods: full must have the keys {sorted(expected)}, got {sorted(full)}")
    for key, shape in expected.items():
        if tuple(full[key].shape) != shape:
            raise ValueError(f"sharded_init_methods: full[{key!r}] must be {shape}, got {tuple(full[key].shape)}")
    if not (0 <= ep_rank < moe_args.ep_size and 0 <= mp_rank < moe_args.mp_size):
        raise ValueError(
            f"sharded_init_methods: need 0 <= ep_rank < {moe_args.ep_size} and 0 <= mp_rank < {moe_args.mp_size}, "
            f"got {ep_rank}, {mp_rank}"
        )
    blocks = {"e": (ep_rank, moe_args.ep_size), "F": (mp_rank, moe_args.mp_size)}

    def shard(key: str) -> torch.Tensor:
        t = full[key]
        for axis, d in enumerate(_dims(key)):
            if d in blocks:
                index, count = blocks[d]
                t = t.chunk(count, dim=axis)[index]
        return t

    return {key: (lambda param, key=key: param.copy_(shard(key))) for key in expected}


# ----------------------------------------------------------------------------------------------- experts


def _new_param(key: str, sizes: Mapping[str, int], init_methods: InitMethods) -> torch.Tensor:
    """A bf16 tensor of this rank's shape of `key` (sizes of its dims on this rank), filled by init_params."""
    param = torch.empty([sizes[d] for d in _dims(key)], dtype=torch.bfloat16)
    init_params(key, param, init_methods)
    return param


class Experts(torch.nn.Module, ABC):
    """A bank of SwiGLU experts `(silu(v·W_in) ⊙ (v·W_swiglu))·W_out` of hidden size hidden_dim (this rank's
    share under TP), stored as the GEMMs read them, output rows first (spec M-11):
    w13 [..., 2·hidden_dim, dim] = [W_in | W_swiglu]ᵀ and w2 [..., dim, hidden_dim] = W_outᵀ, bf16; or FP8
    with rowwise scales [..., 2·hidden_dim] and [..., dim] (precision "fp8_rowwise"). The weights are
    parameters `w13_weight`, `w2_weight` and the scales buffers `w13_scale`, `w2_scale`, so Module.to() and
    state_dict() carry both; `.w13` and `.w2` give them together as ScaledParameter.
    Parameters are created on torch's default device: build inside `with torch.device(...)`.
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.hidden_dim = hidden_dim
        for name in ("w13", "w2"):
            self.register_parameter(f"{name}_weight", None)
            self.register_buffer(f"{name}_scale", None)

    @abstractmethod
    def _weights(self, init_methods: InitMethods) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 (w13, w2) in the layout above, their parts filled by init_params."""

    def build(self, init_methods: InitMethods | None = None, precision: str = "bf16") -> Experts:
        """Create and fill the weights (init_methods: see init_params); quantize them for "fp8_rowwise"."""
        if precision not in PRECISIONS:
            raise ValueError(f"{type(self).__name__}.build: precision must be one of {PRECISIONS}, got {precision!r}")
        init_methods = {} if init_methods is None else init_methods
        _check_init_methods(init_methods)
        for name, weight in zip(("w13", "w2"), self._weights(init_methods), strict=True):
            scale = None
            if precision == "fp8_rowwise":
                weight, scale = quantize_fp8_row(weight)
            setattr(self, f"{name}_weight", torch.nn.Parameter(weight.contiguous(), requires_grad=False))
            setattr(self, f"{name}_scale", scale)
        return self

    def _built(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weights, scales or None) of w13 or w2."""
        weight = getattr(self, f"{name}_weight")
        if weight is None:
            raise RuntimeError(f"{type(self).__name__}: the parameters are not built yet; call build() first")
        return weight, getattr(self, f"{name}_scale")

    def _scaled(self, name: str) -> ScaledParameter:
        return ScaledParameter(*self._built(name))

    @property
    def w13(self) -> ScaledParameter:
        return self._scaled("w13")

    @property
    def w2(self) -> ScaledParameter:
        return self._scaled("w2")

    @property
    def is_fp8_rowwise(self) -> bool:
        return self.w13.is_scaled

    def _grouped_weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(w13 [G, 2·hidden_dim, dim], its scales [G, 2·hidden_dim] or None, w2 [G, dim, hidden_dim], its scales
        [G, dim] or None), G experts (1 for the shared expert)."""
        parts = []
        for weight, scale in (self._built("w13"), self._built("w2")):  # (not the properties: torch.compile
            lead = (slice(None),) if weight.dim() == 3 else (None,)  # cannot trace building a ScaledParameter)
            parts += [weight[lead], None if scale is None else scale[lead]]
        return tuple(parts)


class RoutedExperts(Experts):
    """The num_local_experts routed experts of this EP rank: w13 [EG, 2F, D], w2 [EG, D, F] (F = hidden_dim of
    this TP rank), from moe_w_in_eDF, moe_w_swiglu_eDF [EG, D, F] and moe_w_out_eFD [EG, F, D]."""

    def __init__(self, num_local_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__(dim, hidden_dim)
        self.num_local_experts = num_local_experts

    def _weights(self, init_methods: InitMethods) -> tuple[torch.Tensor, torch.Tensor]:
        sizes = {"e": self.num_local_experts, "D": self.dim, "F": self.hidden_dim}
        w_in, w_out, w_swiglu = (
            _new_param(key, sizes, init_methods) for key in ("moe_w_in_eDF", "moe_w_out_eFD", "moe_w_swiglu_eDF")
        )
        return torch.cat([w_in, w_swiglu], dim=2).transpose(1, 2), w_out.transpose(1, 2)


class SharedExperts(Experts):
    """The shared expert, which every token goes through unscaled: w13 [2F, D], w2 [D, F] (F = hidden_dim of this
    TP rank), from w_in_shared_FD, w_swiglu_FD [F, D] and w_out_shared_DF [D, F]."""

    def _weights(self, init_methods: InitMethods) -> tuple[torch.Tensor, torch.Tensor]:
        sizes = {"D": self.dim, "F": self.hidden_dim}
        w_in, w_out, w_swiglu = (
            _new_param(key, sizes, init_methods) for key in ("w_in_shared_FD", "w_out_shared_DF", "w_swiglu_FD")
        )
        return torch.cat([w_in, w_swiglu], dim=0), w_out


# -------------------------------------------------------------------------------------------- baseline


def _fake_quant_bmm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None) -> torch.Tensor:
    """x [G, M, K] · w [G, N, K]ᵀ -> [G, M, N] in x's dtype, fp32 math. FP8 weights (w_scale [G, N]): x is
    quantized rowwise too and the product of the FP8 values is rescaled ("fake quant")."""
    if w_scale is None:
        return torch.bmm(x.float(), w.float().transpose(1, 2)).to(x.dtype)
    xq, x_scale = quantize_fp8_row(x)
    y = torch.bmm(xq.float(), w.float().transpose(1, 2)) * x_scale[..., None] * w_scale[:, None, :]
    return y.to(x.dtype)


class BaselineMoE(torch.nn.Module):
    """The reference MoE layer (spec M-12): every local expert runs on every token it could receive, masked by
    the routing (zero rows for tokens not routed to it), with bmm; see the module docstring for the math and the
    process groups.

    ep_group, ep_mp_group: process groups of moe_args.ep_size and moe_args.mp_size ranks (None: one rank).
    Call build() before forward().
    """

    def __init__(
        self, ep_group: dist.ProcessGroup | None, ep_mp_group: dist.ProcessGroup | None, moe_args: MoEArgs
    ) -> None:
        super().__init__()
        where = type(self).__name__
        if not isinstance(moe_args, MoEArgs):
            raise ValueError(f"{where}: moe_args must be MoEArgs, got {type(moe_args).__name__}")
        if moe_args.routed_mp_size != moe_args.mp_size:
            raise ValueError(
                f"{where}: moe_args.mp_size_for_routed_experts={moe_args.mp_size_for_routed_experts} must be None "
                f"or mp_size={moe_args.mp_size}: routed and shared experts are both sharded over ep_mp_group"
            )
        for name, group, size_name in (("ep_group", ep_group, "ep_size"), ("ep_mp_group", ep_mp_group, "mp_size")):
            if parallel.group_size(group) != getattr(moe_args, size_name):
                raise ValueError(
                    f"{where}: {name} has {parallel.group_size(group)} rank(s) (None is one) but "
                    f"moe_args.{size_name}={getattr(moe_args, size_name)}"
                )
        self.moe_args = moe_args
        self.ep_group = ep_group
        self.ep_mp_group = ep_mp_group
        self.ep_size = moe_args.ep_size
        self.mp_size = moe_args.mp_size
        self.ep_rank = parallel.group_rank(ep_group)
        self.ep_mp_rank = parallel.group_rank(ep_mp_group)
        self.num_experts = moe_args.num_experts
        self.num_local_experts = moe_args.num_local_experts
        self.top_k = moe_args.top_k
        self.register_parameter("router_DE", None)
        hidden = moe_args.hidden_dim // moe_args.mp_size
        self.routed_experts = RoutedExperts(moe_args.num_local_experts, moe_args.dim, hidden)
        self.shared_experts = SharedExperts(moe_args.dim, hidden)

    def build(self, init_methods: InitMethods | None = None) -> BaselineMoE:
        """Create and fill this rank's parameters on torch's default device (init_methods: see init_params;
        sharded_init_methods loads full weights) and quantize the experts for "fp8_rowwise"."""
        init_methods = {} if init_methods is None else init_methods
        _check_init_methods(init_methods)
        router = _new_param("router_DE", {"D": self.moe_args.dim, "E": self.num_experts}, init_methods)
        self.router_DE = torch.nn.Parameter(router, requires_grad=False)
        self.routed_experts.build(init_methods, self.moe_args.precision)
        self.shared_experts.build(init_methods, self.moe_args.precision)
        return self

    @torch.no_grad()
    def forward(self, x: torch.Tensor, use_static_shape: bool) -> torch.Tensor:
        """x bf16 [B, T, D] -> bf16 [B, T, D], this rank's tokens (the same on every rank of ep_mp_group).

        use_static_shape: exchange fixed-size buffers between EP ranks, without reading any count on the host
        (CUDA-graph friendly; every EP rank must then have the same B·T), instead of exactly the routed rows.
        The baseline always exchanges fixed-size dense tensors (and needs the same B·T on every EP rank).
        """
        tokens = self._tokens(x)
        out = self._forward(tokens, use_static_shape)
        return parallel.all_reduce_(out, self.ep_mp_group).view(x.shape)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] checked, as contiguous tokens [B·T, D]."""
        where = f"{type(self).__name__}.forward"
        if self.router_DE is None:
            raise RuntimeError(f"{where}: the parameters are not built yet; call build() first")
        if x.dim() != 3 or x.shape[2] != self.moe_args.dim or x.dtype != torch.bfloat16:
            raise ValueError(
                f"{where}: x must be bfloat16 [B, T, D={self.moe_args.dim}], got {tuple(x.shape)} {x.dtype}"
            )
        if x.device != self.router_DE.device:
            raise ValueError(f"{where}: x is on {x.device} but the parameters are on {self.router_DE.device}")
        return x.reshape(-1, x.shape[2]).contiguous()

    def _router_scores(self, tokens: torch.Tensor) -> torch.Tensor:
        """sigmoid(tokens · router_DE) in fp32: [N, E]. Both layers route from these scores."""
        return torch.sigmoid(tokens.float() @ self.router_DE.float())

    def _forward(self, tokens: torch.Tensor, use_static_shape: bool) -> torch.Tensor:
        """tokens [N, D] -> this rank's share of the output [N, D] (summed over ep_mp_group by forward)."""
        n, d = tokens.shape
        scores = self._router_scores(tokens)
        chosen = top_experts(scores, self.top_k)  # (ties as index_shuffling breaks them)
        gates = torch.zeros_like(scores).scatter_(1, chosen, scores.gather(1, chosen))  # [N, E], 0: not routed
        masked = (tokens.float()[None] * gates.t()[:, :, None]).to(tokens.dtype)  # [E, N, D]
        # EP: the rows of expert e go to its owner, which runs its experts on the rows of every rank.
        eg = self.num_local_experts
        received = parallel.all_to_all(masked.reshape(-1, d), self.ep_group)  # [EP, EG, N, D], source rank first
        local_in = received.view(self.ep_size, eg, n, d).transpose(0, 1).reshape(eg, -1, d)
        local_out = self._dense_experts(local_in, self.routed_experts)  # [EG, EP·N, D]
        back = local_out.view(eg, self.ep_size, n, d).transpose(0, 1).reshape(-1, d)
        routed = parallel.all_to_all(back, self.ep_group).view(self.num_experts, n, d)
        shared = self._dense_experts(tokens[None], self.shared_experts)[0]
        return (shared.float() + routed.float().sum(0)).to(tokens.dtype)

    @staticmethod
    def _dense_experts(x: torch.Tensor, experts: Experts) -> torch.Tensor:
        """x [G, M, D] -> [G, M, D]: expert g of `experts` on the rows x[g]."""
        w13, s13, w2, s2 = experts._grouped_weights()
        y = _fake_quant_bmm(x, w13, s13).float()
        y0, y1 = y.chunk(2, dim=-1)
        z = (torch.nn.functional.silu(y0) * y1).to(x.dtype)
        return _fake_quant_bmm(z, w2, s2)


# -------------------------------------------------------------------------------------- MetaShuffling


def _scaled_grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._scaled_grouped_mm takes e4m3fn operands on SM90 and SM100 only (its check, torch 2.8 to 2.13)."""
    return (
        hasattr(torch, "_scaled_grouped_mm")
        and x.dtype == w.dtype == torch.float8_e4m3fn
        and arch.is_cuda()
        and arch.capability(x.device) in ((9, 0), (10, 0))
    )


def _grouped_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """Grouped GEMM on contiguous row segments: out[s] = x[s] · w[g]ᵀ for the rows s of group g, i.e.
    offsets[g-1] <= s < offsets[g] (offsets int32 [G], cumulative ends, torch._grouped_mm's convention; rows
    past offsets[-1] are left undefined).

    x [S, K] bf16, or FP8 with x_scale fp32 [S]; w [G, N, K] bf16, or FP8 with w_scale fp32 [G, N] (both
    rowwise: out = (xq · wqᵀ) · x_scale[s] · w_scale[g]). Returns bf16 [S, N]. Paths:
    - CUDA, bf16: torch._grouped_mm (one launch and no host sync on SM90/SM100; torch loops elsewhere);
    - CUDA, FP8 e4m3fn on SM90/SM100: torch._scaled_grouped_mm (fp32 accumulation unless use_fast_accum);
      both take w as the [G, K, N] column-major view of w and need K and N multiples of 16 bytes;
    - otherwise (CPU, other GPUs, odd sizes, a torch without them): a loop over the groups in fp32, which
      reads offsets on the host (a sync).
    A later release swaps in MSLK's grouped GEMM kernels here.
    """
    rows, (_, n, k) = x.shape[0], w.shape
    if rows == 0:
        return x.new_zeros((0, n), dtype=torch.bfloat16)
    align = 16 // x.element_size()
    fast = x.is_cuda and x.is_contiguous() and w.is_contiguous() and k % align == 0 and n % align == 0
    if fast and w_scale is None and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets, out_dtype=torch.bfloat16)
    if fast and w_scale is not None and _scaled_grouped_mm_supported(x, w):
        return torch._scaled_grouped_mm(
            x,
            w.transpose(1, 2),
            x_scale,
            w_scale,
            offs=offsets,
            out_dtype=torch.bfloat16,
            use_fast_accum=use_fast_accum,
        )
    out = torch.zeros((rows, n), dtype=torch.bfloat16, device=x.device)
    ends = offsets.tolist()
    for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        if end > start:
            y = x[start:end].float() @ w[g].float().t()
            if w_scale is not None:
                y = y * x_scale[start:end, None] * w_scale[g]
            out[start:end] = y.to(torch.bfloat16)
    return out


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    """Group sizes [G] -> cumulative ends int32 [G] (torch._grouped_mm's offsets)."""
    return torch.cumsum(counts, 0, dtype=torch.int32)


class MetaShufflingMoE(BaselineMoE):
    """The MoE layer through the MetaShuffling pipeline (spec M-13), equal to BaselineMoE up to rounding; any
    number of experts and any top_k.

    Tokens are routed by index_shuffling (grouped by expert), gathered and scaled by their scores
    (gather_scale(_quant)_dense_tokens), run through the experts as two grouped GEMMs over contiguous expert
    segments with silu_mul(_quant) between them, and scatter-added (scatter_add_dense_tokens, or
    scatter_add_padded_tokens on the static EP path) into the shared expert's output. Paths: _no_comm_forward
    (ep_size 1), _static_comm_forward (use_static_shape) and _dynamic_comm_forward; see each. With dedup_comm
    the TP ranks split the columns of the EP exchange.
    """

    def _forward(self, tokens: torch.Tensor, use_static_shape: bool) -> torch.Tensor:
        if self.ep_size == 1:
            return self._no_comm_forward(tokens)
        if use_static_shape:
            return self._static_comm_forward(tokens)
        return self._dynamic_comm_forward(tokens)

    def _no_comm_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Every expert is local: route, gather (and quantize, for FP8) in expert order, run, scatter-add."""
        scores, counts, expert_ids, token_ids = self._route(tokens)
        out = self._shared_expert(tokens)
        if self.routed_experts.is_fp8_rowwise:
            x, x_scale = gather_scale_quant_dense_tokens(tokens, token_ids, expert_ids, scores)
        else:
            x, x_scale = gather_scale_dense_tokens(tokens, token_ids, expert_ids, scores), None
        y = self._run_experts(x, self.routed_experts, _offsets(counts[: self.num_experts]), x_scale)
        scatter_add_dense_tokens(out, y, token_ids)
        return out

    def _static_comm_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """EP with fixed sizes and no host sync (CUDA-graph friendly). Each rank has R = N·top_k routed rows,
        grouped by expert; every rank all-gathers them all, [EP·R, D] in slabs of R rows, with their counts
        [EP, E], keeps its experts' rows (combine_shuffling of experts [ep_rank·EG, (ep_rank+1)·EG), is_padded),
        runs them (valid_token_count: the rows after them are padding) and puts the outputs back in place
        (split_shuffling). An all_to_all of the slabs brings every rank, in slab r, its rows run by rank r at their
        places, where scatter_add_padded_tokens picks them up. Every EP rank must have the same N."""
        scores, counts, expert_ids, token_ids = self._route(tokens)
        gathered = gather_scale_dense_tokens(tokens, token_ids, expert_ids, scores)  # [R, D], by expert
        out = self._shared_expert(tokens)
        send_counts = counts[: self.num_experts]
        all_counts = parallel.all_gather_rows(send_counts[None], self.ep_group)  # [EP, E]
        first_expert = self.ep_rank * self.num_local_experts
        y = self._local_experts(self._dispatch(gathered), all_counts, first_expert, is_padded=True)
        returned = self._return(y).view(self.ep_size, *gathered.shape)
        scatter_add_padded_tokens(returned, send_counts, token_ids, out)
        return out

    def _dynamic_comm_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """EP with exact sizes: the per-expert counts go first (all_to_all), the host reads how many rows go to
        and come from each rank (one sync), then exactly the routed rows travel both ways (all_to_all), arriving
        rank by rank, each rank's by expert: combine_shuffling regroups them by expert and split_shuffling back."""
        scores, counts, expert_ids, token_ids = self._route(tokens)
        gathered = gather_scale_dense_tokens(tokens, token_ids, expert_ids, scores)  # [R, D], by expert
        out = self._shared_expert(tokens)
        send_counts = counts[: self.num_experts]
        recv_counts = parallel.all_to_all(send_counts, self.ep_group).view(self.ep_size, -1)  # [EP, EG]
        splits = torch.cat([send_counts.view(self.ep_size, -1).sum(1), recv_counts.sum(1)]).tolist()
        send_splits, recv_splits = splits[: self.ep_size], splits[self.ep_size :]
        received = self._dispatch(gathered, send_splits, recv_splits)
        y = self._local_experts(received, recv_counts, 0, is_padded=False)
        scatter_add_dense_tokens(out, self._return(y, recv_splits, send_splits), token_ids)
        return out

    def _route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores fp32 [N, E], counts int32 [E+2], expert_ids [N·k], token_ids [N·k]) as index_shuffling gives
        them: the N·k routed (token, expert) pairs grouped by (global) expert."""
        scores = self._router_scores(tokens)
        counts, expert_ids, token_ids = index_shuffling(scores, top_k=self.top_k)
        return scores, counts, expert_ids, token_ids

    def _shared_expert(self, tokens: torch.Tensor) -> torch.Tensor:
        """The shared expert on tokens [N, D] (one group of N rows), bf16 [N, D]."""
        offsets = torch.full((1,), tokens.shape[0], dtype=torch.int32, device=tokens.device)
        return self._run_experts(tokens, self.shared_experts, offsets)

    def _run_experts(
        self,
        x: torch.Tensor,
        experts: Experts,
        offsets: torch.Tensor,
        x_scale: torch.Tensor | None = None,
        valid_token_count: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [S, D] grouped by expert (offsets: cumulative ends, int32 [G]) through `experts` -> bf16 [S, D].
        FP8 experts take x quantized rowwise (x FP8 with x_scale [S]; bf16 x is quantized here). Rows at or past
        valid_token_count are padding."""
        w13, s13, w2, s2 = experts._grouped_weights()
        fast_accum = self.moe_args.use_fast_accum
        if s13 is not None and x_scale is None:
            x, x_scale = quantize_fp8_row(x)
        y = _grouped_matmul(x, w13, offsets, x_scale, s13, fast_accum)  # [S, 2F]
        y0, y1 = y.chunk(2, dim=1)
        if s2 is not None:
            z, z_scale = silu_mul_quant(y0, y1, valid_token_count=valid_token_count)
        else:
            z, z_scale = silu_mul(y0, y1, valid_token_count), None
        return _grouped_matmul(z, w2, offsets, z_scale, s2, fast_accum)

    def _local_experts(
        self, received: torch.Tensor, counts: torch.Tensor, first_expert: int, is_padded: bool
    ) -> torch.Tensor:
        """Rows received from the EP ranks [rows, D], rank by rank (is_padded: in slabs of rows/EP), each rank's
        grouped by expert (counts [EP, experts]), through this rank's experts [first_expert, first_expert + EG)
        of them; the outputs in the same places, zeros elsewhere."""
        experts = (first_expert, first_expert + self.num_local_experts)
        x, local_counts = combine_shuffling(received, counts, *experts, is_padded=is_padded)
        groups = self.num_local_experts
        valid = local_counts[groups:] if is_padded else None  # padding after the real rows: skip it
        y = self._run_experts(x, self.routed_experts, _offsets(local_counts[:groups]), valid_token_count=valid)
        return split_shuffling(y, counts, *experts, is_padded=is_padded)

    @property
    def _dedup(self) -> bool:
        return self.moe_args.dedup_comm and self.mp_size > 1

    def _dispatch(
        self, rows: torch.Tensor, send_splits: list[int] | None = None, recv_splits: list[int] | None = None
    ) -> torch.Tensor:
        """Rows [R, D] to the EP ranks -> the rows received from them, rank by rank: send_splits[r] rows to rank r
        and recv_splits[r] from it (all_to_all), or without splits all of them to every rank (all_gather).
        dedup_comm: each TP rank sends its column block, and the TP ranks gather the blocks into whole rows."""
        if self._dedup:
            rows = parallel.column_block(rows, self.ep_mp_group).contiguous()
        if send_splits is None:
            received = parallel.all_gather_rows(rows, self.ep_group)
        else:
            received = parallel.all_to_all(rows, self.ep_group, send_splits, recv_splits)
        return parallel.all_gather_columns(received, self.ep_mp_group) if self._dedup else received

    def _return(
        self, rows: torch.Tensor, send_splits: list[int] | None = None, recv_splits: list[int] | None = None
    ) -> torch.Tensor:
        """The experts' outputs [R', D] back to the ranks whose rows they are (all_to_all: send_splits[r] rows to
        rank r, recv_splits[r] from it; None: equal slabs). dedup_comm: the TP ranks sum their shares and each
        sends back its column block (reduce_scatter), which arrives zero-padded to D; the final all_reduce over
        ep_mp_group completes the rows either way."""
        if not self._dedup:
            return parallel.all_to_all(rows, self.ep_group, send_splits, recv_splits)
        block = parallel.all_to_all(
            parallel.reduce_scatter_columns(rows, self.ep_mp_group), self.ep_group, send_splits, recv_splits
        )
        width = block.shape[1]
        left = width * self.ep_mp_rank
        return torch.nn.functional.pad(block, (left, rows.shape[1] - left - width))
