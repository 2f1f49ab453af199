"""The attention masks (spec §3, `mslk.attention.fmha.attn_bias`): what each query may attend to.

Notation, per block (one sequence of a varlen batch, or the whole tensor for the non-block masks): query i in
[0, nq), key j in [0, nk), s = nk − nq (the bottom-right shift). A mask allows (i, j) or not; `materialize`
gives the dense additive mask (0 allowed, −inf not), for debugging and as the oracle of the kernels' tests.

Varlen ("block diagonal") masks describe a batch packed into one sequence (B = 1): q [1, Σnq, H, K] and keys
either packed (Σnk), in slots of `padding` keys (padded keys), or at arbitrary starts (gappy keys). Their
sequence metadata (`_SeqLenInfo` and subclasses) holds the starts as an int32 tensor for the kernels and as a
Python list. Paged masks (B15-B17, B21-B22) read their keys through a page table: logical key j of sequence b
lives in physical page block_tables[b, j // page_size] of a shared pool.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch


def _default_device() -> torch.device:
    """Where masks put their metadata unless told: cuda, else mtia, else cpu (spec §3)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    mtia = getattr(torch, "mtia", None)  # (which Dynamo cannot ask: compiled, a host without CUDA gets cpu)
    if mtia is not None and not torch.compiler.is_compiling() and mtia.is_available():
        return torch.device("mtia")
    return torch.device("cpu")


def _int(name: str, value) -> int:
    """value as a Python int (a Python or NumPy integer, an integer tensor of one element); a float or a bool is
    refused rather than truncated, before any metadata holds it."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an integer, got {value!r}")


def _ints(name: str, values: Iterable) -> list[int]:
    values = list(values)
    try:
        return [_int(name, v) for v in values]
    except TypeError:
        raise TypeError(f"{name} must be integers, got {values}") from None


def _int_tensor(values: Sequence[int], device) -> torch.Tensor:
    values = list(values)
    tensor = torch.empty(len(values), dtype=torch.int32, device=device or _default_device())
    _write(tensor, values)
    return tensor


def _write(tensor: torch.Tensor, values: Sequence[int]) -> None:
    """values into the int32 tensor; on a CUDA GPU from pinned memory, without waiting (a copy from pageable memory
    synchronizes the stream), as upstream does."""
    host = torch.tensor(list(values), dtype=torch.int32)
    if tensor.device.type == "cuda":  # (the device itself: the offline SASS checks fake `is_cuda` on CPU tensors)
        tensor.copy_(host.pin_memory(), non_blocking=True)
    else:
        tensor.copy_(host)


class AttentionBias:
    """Base of the masks (B00); a plain tensor bias is passed as a torch.Tensor instead."""

    def _allowed(self, i: torch.Tensor, j: torch.Tensor, nq: int, nk: int) -> torch.Tensor:
        """Whether query i may see key j inside one block of nq queries and nk keys (broadcasting i, j)."""
        raise NotImplementedError

    def _blocks(self, mq: int, mk: int) -> Iterable[tuple[int, int, int, int]]:
        """(q start, q end, k start, k end) of each block; the whole matrix for non-block masks."""
        yield 0, mq, 0, mk

    def materialize(self, shape: Sequence[int], dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
        """The dense additive mask of shape [..., Mq, Mkv]: 0 where allowed, −inf elsewhere."""
        mq, mk = shape[-2], shape[-1]
        mask = torch.full((mq, mk), -math.inf, dtype=torch.float32, device=device)
        for q0, q1, k0, k1 in self._blocks(mq, mk):
            i = torch.arange(q1 - q0, device=device)[:, None]
            j = torch.arange(k1 - k0, device=device)[None, :]
            allowed = self._allowed(i, j, q1 - q0, k1 - k0)
            mask[q0:q1, k0:k1] = torch.where(allowed, 0.0, -math.inf)
        return mask.to(dtype).expand(*shape)

    def to(self, device) -> AttentionBias:
        return self


def _check_window(name: str, value: int, minimum: int) -> int:
    """value as a Python int >= minimum (a float or a bool is refused, not truncated: the kernels take ints)."""
    value = _int(name, value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _local(i, j, shift: int, left: int, right: int) -> torch.Tensor:
    """−left <= j − i − shift <= right."""
    d = j - i - shift
    return (d >= -left) & (d <= right)


def _materialize_causal_mask(
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    device="cpu",
    *,
    window_size: int | None = None,
    from_bottomright: bool = False,
) -> torch.Tensor:
    """Upstream's causal mask helper (users' tests import it): [..., Mq, Mkv], 0 where j <= i + s (s = Mkv − Mq
    from the bottom right, else 0) and, with a window_size w, j > i + s − w; −inf elsewhere."""
    mq, mk = shape[-2], shape[-1]
    i, j = torch.arange(mq, device=device)[:, None], torch.arange(mk, device=device)[None, :]
    left = mq + mk if window_size is None else window_size - 1
    allowed = _local(i, j, mk - mq if from_bottomright else 0, left, 0)
    return torch.where(allowed, 0.0, -math.inf).to(dtype).expand(*shape).contiguous()


class _Checked:
    """Runs the parents' __post_init__ (dataclass masks chain their checks)."""

    def __post_init__(self) -> None:
        # The next class after _Checked that defines one (Dynamo cannot trace `getattr(super(), ...)`).
        mro = type(self).__mro__
        parent = next((c for c in mro[mro.index(_Checked) + 1 :] if "__post_init__" in vars(c)), None)
        if parent is not None:
            parent.__post_init__(self)


class _CausalFromBottomRight:
    """Rule: j <= i + s."""

    def _allowed(self, i, j, nq, nk):
        return j <= i + (nk - nq)


class _WindowFromBottomRight(_Checked):
    """Rule: bottom-right causal over a window of `_window_size` keys, s − w < j − i <= s."""

    _window_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        self._window_size = _check_window("window_size", self._window_size, 1)

    def _allowed(self, i, j, nq, nk):
        return _local(i, j, nk - nq, self._window_size - 1, 0)


class _LocalFromBottomRight(_Checked):
    """Rule: −window_left <= j − i − s <= window_right."""

    window_left: int
    window_right: int

    def __post_init__(self) -> None:
        super().__post_init__()
        self.window_left = _check_window("window_left", self.window_left, 0)
        self.window_right = _check_window("window_right", self.window_right, 0)

    def _allowed(self, i, j, nq, nk):
        return _local(i, j, nk - nq, self.window_left, self.window_right)


def _check_materialized_shape(mask, shape, queries: int, keys: int) -> None:
    """A varlen mask materializes to [..., at least its query rows, at least its key rows (paged: the pool rows its
    page table reaches)]: rows and columns past them are −inf (tensors may hold more rows than the lengths, as
    after an in-place update under a CUDA graph); fewer cannot hold the mask."""
    if len(shape) < 2 or shape[-2] < queries or shape[-1] < keys:
        raise ValueError(
            f"{type(mask).__name__}.materialize: shape must be [..., >= {queries}, >= {keys}] (the mask's query and "
            f"key rows), got {tuple(shape)}"
        )


# ----------------------------------------------------------------------------------------- B01-B05


class LowerTriangularMask(AttentionBias):
    """B01: causal from the top left, j <= i. `device` is accepted for compatibility and unused."""

    def __init__(self, device=None) -> None:
        del device

    def _allowed(self, i, j, nq, nk):
        return j <= i

    def add_bias(self, bias: torch.Tensor) -> LowerTriangularMaskWithTensorBias:
        return LowerTriangularMaskWithTensorBias(bias)


class LowerTriangularMaskWithTensorBias(LowerTriangularMask):
    """B02: B01 plus a dense additive bias."""

    def __init__(self, bias: torch.Tensor) -> None:
        self._bias = bias

    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        return super().materialize(shape, dtype, device) + self._bias.to(dtype=dtype, device=device)

    def to(self, device) -> LowerTriangularMaskWithTensorBias:
        return LowerTriangularMaskWithTensorBias(self._bias.to(device))


class LowerTriangularFromBottomRightMask(_CausalFromBottomRight, AttentionBias):
    """B03: causal from the bottom right, j <= i + s (the last query sees the last key)."""

    def make_local_attention(self, window_size: int) -> LowerTriangularFromBottomRightLocalAttentionMask:
        return LowerTriangularFromBottomRightLocalAttentionMask(window_size)


@dataclass
class LowerTriangularFromBottomRightLocalAttentionMask(_WindowFromBottomRight, LowerTriangularFromBottomRightMask):
    """B04: bottom-right causal over the last `_window_size` keys: s − w < j − i <= s."""

    _window_size: int


@dataclass
class LocalAttentionFromBottomRightMask(_LocalFromBottomRight, AttentionBias):
    """B05: a window around the bottom-right diagonal: −window_left <= j − i − s <= window_right."""

    window_left: int
    window_right: int


# ------------------------------------------------------------------------------------ sequence metadata


@dataclass
class _SeqLenInfo:
    """Packed sequences: sequence b is rows [seqstart[b], seqstart[b + 1])."""

    seqstart: torch.Tensor  # int32 [B + 1], on the device
    max_seqlen: int
    min_seqlen: int
    seqstart_py: list[int]

    @classmethod
    def from_seqlens(cls, seqlens: Iterable[int], *, device=None) -> _SeqLenInfo:
        lengths = _ints("sequence lengths", seqlens)
        if any(n < 0 for n in lengths):
            raise ValueError(f"sequence lengths must be >= 0, got {lengths}")
        starts = [0, *itertools.accumulate(lengths)]  # (Python ints: torch.export traces no tensor here)
        return cls(_int_tensor(starts, device), max(lengths, default=0), min(lengths, default=0), starts)

    def intervals(self) -> Iterable[tuple[int, int]]:
        return zip(self.seqstart_py[:-1], self.seqstart_py[1:], strict=True)

    def _update(self, lengths: list[int], starts: list[int], longest: int, what: str) -> None:
        """New lengths for a CUDA graph that captured this metadata: the tensors are written in place, the batch
        size must stay and no length may pass `longest` (what the captured kernels were sized by)."""
        if len(lengths) != len(self.seqstart_py) - 1:
            raise ValueError(
                f"in-place update: {len(lengths)} sequences, the captured batch has {len(self.seqstart_py) - 1}"
            )
        if any(not 0 <= n <= longest for n in lengths):
            raise ValueError(f"in-place update: lengths must be in [0, {what}={longest}], got {lengths}")
        _write(self.seqstart, starts)
        self.seqstart_py[:] = starts
        self.min_seqlen = min(lengths, default=0)  # max_seqlen stays the bound the graph was captured with

    def from_seqlens_inplace(self, seqlens: Iterable[int]) -> None:
        """Packed sequences of new lengths (at most the captured max_seqlen) in this metadata's tensors."""
        lengths = _ints("sequence lengths", seqlens)
        starts = [0, *itertools.accumulate(lengths)]  # (Python ints: torch.export traces no tensor here)
        self._update(lengths, starts, self.max_seqlen, "max_seqlen")

    def lengths(self) -> list[int]:
        return [end - start for start, end in self.intervals()]

    def to(self, device) -> _SeqLenInfo:
        return replace(self, seqstart=self.seqstart.to(device))


@dataclass
class _PaddedSeqLenInfo(_SeqLenInfo):
    """Keys in slots of `padding` rows: sequence b is rows [b · padding, b · padding + seqlen[b])."""

    seqlen: torch.Tensor  # int32 [B]
    seqlen_py: list[int]
    padding: int

    @classmethod
    def from_seqlens_padded(cls, seqlens: Iterable[int], padding: int, *, device=None) -> _PaddedSeqLenInfo:
        lengths, padding = _ints("key lengths", seqlens), _int("padding", padding)
        if padding < 0 or any(not 0 <= n <= padding for n in lengths):
            raise ValueError(f"key lengths must be in [0, padding={padding}], got {lengths}")
        starts = [b * padding for b in range(len(lengths) + 1)]
        return cls(
            _int_tensor(starts, device), max(lengths, default=0), min(lengths, default=0), starts,
            _int_tensor(lengths, device), lengths, padding,
        )  # fmt: skip

    def intervals(self) -> Iterable[tuple[int, int]]:
        return ((start, start + n) for start, n in zip(self.seqstart_py, self.seqlen_py, strict=False))

    def from_seqlens_inplace(self, seqlens: Iterable[int]) -> None:
        """Refused: packed starts would move the slots (the kernels would read the wrong rows)."""
        raise ValueError("in-place update of padded keys: use from_seqlens_padded_inplace (the slots stay put)")

    def from_seqlens_padded_inplace(self, seqlens: Iterable[int]) -> None:
        """New key lengths (each at most padding) in this metadata's tensors, for a captured CUDA graph."""
        lengths = _ints("key lengths", seqlens)
        self._update(lengths, list(self.seqstart_py), self.padding, "padding")
        self.max_seqlen = max([self.max_seqlen, *lengths])
        _write(self.seqlen, lengths)
        self.seqlen_py[:] = lengths

    def to(self, device) -> _PaddedSeqLenInfo:
        return replace(self, seqstart=self.seqstart.to(device), seqlen=self.seqlen.to(device))


@dataclass
class _GappySeqInfo(_SeqLenInfo):
    """Keys anywhere: sequence b is rows [seqstart[b], seqstart[b] + seqlen[b]); seqstart has B + 1 entries,
    the last the total number of key rows. Paged (B21, B22; upstream's layout): each sequence lies in a lane of its
    own, seqstart[b] is where it starts inside lane b (the (B + 1)-th entry, -1, means nothing), and seqlen[b] is
    where it ends there (start + length); max_seqlen and min_seqlen are still of the lengths."""

    seqlen: torch.Tensor  # int32 [B]
    seqlen_py: list[int]
    paged: bool = False

    @classmethod
    def from_seqlens_gappy(
        cls, seqstarts: Sequence[int], seqlens: Sequence[int], paged: bool = False, *, device=None
    ) -> _GappySeqInfo:
        """seqstarts: B + 1 entries (the last the number of key rows), or paged, B (where each sequence starts
        inside its lane)."""
        starts, lengths = _ints("kv_seqstarts", seqstarts), _ints("kv_seqlen", seqlens)
        if paged:
            if len(starts) != len(lengths) or any(s < 0 or n < 0 for s, n in zip(starts, lengths, strict=True)):
                raise ValueError(
                    f"paged gappy keys need one start (inside its lane) and one length per sequence, none negative, "
                    f"got starts {starts} and lengths {lengths}"
                )
            starts, ends = [*starts, -1], [s + n for s, n in zip(starts, lengths, strict=True)]
        elif len(starts) != len(lengths) + 1 or any(
            s < 0 or s + n > starts[-1] or n < 0 for s, n in zip(starts, lengths, strict=False)
        ):
            raise ValueError(
                f"kv_seqstarts must have B + 1 entries (the last the number of key rows) and each sequence must "
                f"fit, got starts {starts} and lengths {lengths}"
            )
        ends_or_lengths = ends if paged else lengths
        return cls(
            _int_tensor(starts, device), max(lengths, default=0), min(lengths, default=0), starts,
            _int_tensor(ends_or_lengths, device), ends_or_lengths, paged,
        )  # fmt: skip

    def intervals(self) -> Iterable[tuple[int, int]]:
        """Each sequence's rows; paged, its positions inside its lane."""
        if self.paged:
            return zip(self.seqstart_py, self.seqlen_py, strict=False)
        return ((start, start + n) for start, n in zip(self.seqstart_py, self.seqlen_py, strict=False))

    def lanes_laid_out(self, lane: int) -> _GappySeqInfo:
        """Paged keys as the unpaged layout of their lanes laid out one after another (lane b from row b · lane),
        the device tensors computed on the device (no host sync)."""
        count = len(self.seqlen_py)
        offsets = [b * lane for b in range(count + 1)]
        starts = [offset + start for offset, start in zip(offsets[:count], self.seqstart_py[:count], strict=True)]
        lengths = [end - start for start, end in self.intervals()]
        device_offsets = torch.arange(count + 1, dtype=torch.int32, device=self.seqstart.device) * lane
        device_starts = self.seqstart[:count]
        return _GappySeqInfo(
            torch.cat([device_offsets[:count] + device_starts, device_offsets[count:]]), self.max_seqlen,
            self.min_seqlen, [*starts, count * lane], self.seqlen - device_starts, lengths,
        )  # fmt: skip

    def from_seqlens_inplace(self, seqlens: Iterable[int]) -> None:
        """Refused: packed starts would replace the keys' own (the kernels would read the wrong rows)."""
        raise ValueError("in-place update of gappy keys is not supported: build the mask anew")

    def to(self, device) -> _GappySeqInfo:
        return replace(self, seqstart=self.seqstart.to(device), seqlen=self.seqlen.to(device))


# ----------------------------------------------------------------------------------- block masks B06-B10


@dataclass
class _BlockDiagonal(AttentionBias):
    """A varlen batch packed with B = 1: query block b sees key block b only (full attention inside). The base
    of B06 and of the padded (B11) and gappy (B18) key masks, which upstream are not BlockDiagonalMasks."""

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _SeqLenInfo

    def __post_init__(self) -> None:
        if len(self.q_seqinfo.seqstart_py) != len(self.k_seqinfo.seqstart_py):
            raise ValueError(
                f"{type(self).__name__}: {len(self.q_seqinfo.seqstart_py) - 1} query blocks but "
                f"{len(self.k_seqinfo.seqstart_py) - 1} key blocks"
            )

    def _allowed(self, i, j, nq, nk):
        return torch.ones_like(i + j, dtype=torch.bool)

    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        _check_materialized_shape(self, shape, self.q_seqinfo.seqstart_py[-1], self.k_seqinfo.seqstart_py[-1])
        return super().materialize(shape, dtype, device)

    def _blocks(self, mq, mk):
        for (q0, q1), (k0, k1) in zip(self.q_seqinfo.intervals(), self.k_seqinfo.intervals(), strict=True):
            yield q0, q1, k0, k1

    def to(self, device):
        q = self.q_seqinfo.to(device)
        k = q if self.k_seqinfo is self.q_seqinfo else self.k_seqinfo.to(device)  # shared stays shared
        return replace(self, q_seqinfo=q, k_seqinfo=k)

    def _split(self, t: torch.Tensor, info: _SeqLenInfo) -> list[torch.Tensor]:
        rows = info.seqstart_py[-1]
        if t.dim() < 2 or t.shape[0] != 1 or t.shape[1] != rows:
            raise ValueError(
                f"{type(self).__name__}: varlen tensors have batch size 1 and {rows} rows (shape [1, {rows}, ...]), "
                f"got shape {tuple(t.shape)}"
            )
        return [t[:, start:end] for start, end in info.intervals()]

    def split_queries(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._split(t, self.q_seqinfo)

    def split_kv(self, t: torch.Tensor) -> list[torch.Tensor]:
        return self._split(t, self.k_seqinfo)

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The packed output [1, Σnq, ...] back as its sequences (for B06, as the list given to from_tensor_list)."""
        return self.split_queries(t)


@dataclass
class BlockDiagonalMask(_BlockDiagonal):
    """B06: varlen batch packed with B = 1; query block b sees key block b only (full attention inside)."""

    _batch_sizes: Sequence[int] | None = None

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int], kv_seqlen: Sequence[int] | None = None, *, device=None):
        """Blocks of q_seqlen queries and kv_seqlen keys (the same lengths when kv_seqlen is None)."""
        q = _SeqLenInfo.from_seqlens(q_seqlen, device=device)
        # kv_seqlen None: one info for queries and keys, which in-place updates (CUDA graphs) move together; given,
        # even equal, the keys' own, which updates may make unequal.
        k = q if kv_seqlen is None else _SeqLenInfo.from_seqlens(kv_seqlen, device=device)
        return cls(q_seqinfo=q, k_seqinfo=k)

    @classmethod
    def from_tensor_list(cls, tensors: Sequence[torch.Tensor]) -> tuple[BlockDiagonalMask, torch.Tensor]:
        """Tensors [B_i, M_i, ...] -> (the mask of their B_i · M_i-row sequences, their rows packed [1, Σ, ...])."""
        batch_sizes = [t.shape[0] for t in tensors]
        if not batch_sizes or 0 in batch_sizes:
            # split() could not give a batch-0 tensor back: no packed sequence records its length
            raise ValueError(f"from_tensor_list: tensors of batch size >= 1 (leave empty ones out), got {batch_sizes}")
        seqlens = [t.shape[1] for t in tensors for _ in range(t.shape[0])]
        mask = cls.from_seqlens(seqlens, device=tensors[0].device)
        mask._batch_sizes = batch_sizes
        return mask, torch.cat([t.reshape(1, -1, *t.shape[2:]) for t in tensors], dim=1)

    @classmethod
    def from_tensor_lists_qkv(cls, tensors_q, tensors_k, tensors_v=None):
        """(mask, q, k, v) packed from per-input lists (v None when tensors_v is None)."""
        if len(tensors_q) != len(tensors_k) or [t.shape[0] for t in tensors_q] != [t.shape[0] for t in tensors_k]:
            raise ValueError("from_tensor_lists_qkv: q and k tensors must have the same batch sizes")
        if tensors_v is not None and [t.shape[:2] for t in tensors_v] != [t.shape[:2] for t in tensors_k]:
            raise ValueError(
                f"from_tensor_lists_qkv: each v tensor must have its k tensor's batch size and length, got v "
                f"{[tuple(t.shape[:2]) for t in tensors_v]} and k {[tuple(t.shape[:2]) for t in tensors_k]}"
            )
        mask_q, q = cls.from_tensor_list(tensors_q)
        mask_k, k = cls.from_tensor_list(tensors_k)
        v = None if tensors_v is None else cls.from_tensor_list(tensors_v)[1]
        return cls(mask_q.q_seqinfo, mask_k.q_seqinfo, mask_q._batch_sizes), q, k, v

    def _split(self, t: torch.Tensor, info: _SeqLenInfo) -> list[torch.Tensor]:
        parts = super()._split(t, info)
        if self._batch_sizes is None:
            return parts
        out, first = [], 0
        for size in self._batch_sizes:  # sequences of one input tensor regrouped as its batch
            out.append(torch.cat([p.reshape(1, *p.shape[1:]) for p in parts[first : first + size]]))
            first += size
        return out

    def _derive(self, cls, **fields):
        return cls(q_seqinfo=self.q_seqinfo, k_seqinfo=self.k_seqinfo, _batch_sizes=self._batch_sizes, **fields)

    def make_causal(self) -> BlockDiagonalCausalMask:
        return self._derive(BlockDiagonalCausalMask)

    def make_causal_from_bottomright(self) -> BlockDiagonalCausalFromBottomRightMask:
        return self._derive(BlockDiagonalCausalFromBottomRightMask)

    def make_local_attention(self, window_size: int) -> BlockDiagonalCausalLocalAttentionMask:
        return self._derive(BlockDiagonalCausalLocalAttentionMask, _window_size=window_size)

    def make_local_attention_from_bottomright(
        self, window_size: int
    ) -> BlockDiagonalCausalLocalAttentionFromBottomRightMask:
        return self._derive(BlockDiagonalCausalLocalAttentionFromBottomRightMask, _window_size=window_size)


@dataclass
class BlockDiagonalCausalMask(BlockDiagonalMask):
    """B07: B06 and causal from the top left inside each block, j <= i."""

    def _allowed(self, i, j, nq, nk):
        return j <= i


def _check_keys_cover_queries(mask: BlockDiagonalMask) -> None:
    for nq, nk in zip(mask.q_seqinfo.lengths(), mask.k_seqinfo.lengths(), strict=True):
        if nk < nq:
            raise ValueError(f"{type(mask).__name__}: a block has fewer keys ({nk}) than queries ({nq})")


@dataclass
class BlockDiagonalCausalFromBottomRightMask(_CausalFromBottomRight, BlockDiagonalMask):
    """B08: B06 and causal from the bottom right inside each block, j <= i + s; every block needs nk >= nq."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_keys_cover_queries(self)


@dataclass
class BlockDiagonalCausalLocalAttentionMask(BlockDiagonalCausalMask):
    """B09: B07 over the last `_window_size` keys of each query, i − w < j <= i."""

    _window_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._window_size = _check_window("window_size", self._window_size, 1)
        for nq, nk in zip(self.q_seqinfo.lengths(), self.k_seqinfo.lengths(), strict=True):
            if nq - self._window_size >= nk:
                raise RuntimeError(
                    f"{type(self).__name__}: a block of {nq} queries and {nk} keys leaves its last queries without "
                    f"keys for window {self._window_size}"
                )

    def _allowed(self, i, j, nq, nk):
        return _local(i, j, 0, self._window_size - 1, 0)


@dataclass
class BlockDiagonalCausalLocalAttentionFromBottomRightMask(
    _WindowFromBottomRight, BlockDiagonalCausalFromBottomRightMask
):
    """B10: B08 over a window of `_window_size` keys, s − w < j − i <= s."""

    _window_size: int = 0


# ----------------------------------------------------------------------------- padded keys, B11-B14


@dataclass
class BlockDiagonalPaddedKeysMask(_BlockDiagonal):
    """B11: keys in slots of `padding` rows (a KV cache), block b's keys [b · padding, b · padding + n_b);
    full attention inside a block."""

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _PaddedSeqLenInfo

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_padding: int, kv_seqlen, causal_diagonal=None, *, device=None):
        """causal_diagonal is unused, as upstream's (kept so that code passing it still runs)."""
        return cls(
            q_seqinfo=_SeqLenInfo.from_seqlens(q_seqlen, device=device),
            k_seqinfo=_PaddedSeqLenInfo.from_seqlens_padded(kv_seqlen, kv_padding, device=device),
        )

    def make_local_attention(self, window_left: int, window_right: int) -> BlockDiagonalLocalAttentionPaddedKeysMask:
        return BlockDiagonalLocalAttentionPaddedKeysMask(self.q_seqinfo, self.k_seqinfo, window_left, window_right)

    def make_paged(
        self, block_tables: torch.Tensor, page_size: int, paged_type: type[PagedBlockDiagonalPaddedKeysMask]
    ) -> PagedBlockDiagonalPaddedKeysMask:
        """These sequences with their keys read through the page table (B15-B17): each lane pads its keys to
        max_pages · page_size. paged_type's rule applies (B16 on a B11 makes it causal, as upstream's)."""
        if not (isinstance(paged_type, type) and issubclass(paged_type, PagedBlockDiagonalPaddedKeysMask)):
            raise ValueError(f"make_paged: paged_type must be a paged padded-keys mask (B15-B17), got {paged_type}")
        padding = _lane_length(paged_type, block_tables, page_size)
        k = self.k_seqinfo
        keys = _PaddedSeqLenInfo.from_seqlens_padded(k.seqlen_py, padding, device=k.seqstart.device)
        return paged_type(self.q_seqinfo, keys, block_tables, page_size, **_rule_fields(self, paged_type))


@dataclass
class BlockDiagonalCausalWithOffsetPaddedKeysMask(_CausalFromBottomRight, BlockDiagonalPaddedKeysMask):
    """B12, the decode / KV-cache mask: B11 and causal from the bottom right over the used keys, j <= i + s."""

    causal_diagonal: object = None  # unused, as upstream's (kept so that code passing it still runs)


@dataclass
class BlockDiagonalLocalAttentionPaddedKeysMask(_LocalFromBottomRight, BlockDiagonalPaddedKeysMask):
    """B13: B11 and −window_left <= j − i − s <= window_right in each block."""

    window_left: int
    window_right: int

    @classmethod
    def from_seqlens_local(cls, q_seqlen, kv_padding, kv_seqlen, window_left, window_right, *, device=None):
        base = BlockDiagonalPaddedKeysMask.from_seqlens(q_seqlen, kv_padding, kv_seqlen, device=device)
        return cls(base.q_seqinfo, base.k_seqinfo, window_left, window_right)


@dataclass
class BlockDiagonalCausalLocalAttentionPaddedKeysMask(_WindowFromBottomRight, BlockDiagonalPaddedKeysMask):
    """B14: B11 and s − w < j − i <= s in each block (bottom-right causal over a window of w keys)."""

    _window_size: int

    @classmethod
    def from_seqlens_local(cls, q_seqlen, kv_padding, kv_seqlen, window_size, *, device=None):
        base = BlockDiagonalPaddedKeysMask.from_seqlens(q_seqlen, kv_padding, kv_seqlen, device=device)
        return cls(base.q_seqinfo, base.k_seqinfo, window_size)


def _rule_fields(mask: AttentionBias, paged_type: type) -> dict:
    """The fields of paged_type beyond the paging ones (a window), taken from the unpaged mask."""
    paging = ("q_seqinfo", "k_seqinfo", "block_tables", "page_size")
    names = [f.name for f in fields(paged_type) if f.name not in paging]
    missing = [name for name in names if not hasattr(mask, name)]
    if missing:
        raise ValueError(f"make_paged: {paged_type.__name__} needs {missing}, which {type(mask).__name__} lacks")
    return {name: getattr(mask, name) for name in names}


# ------------------------------------------------------------------------------- gappy keys, B18-B20


@dataclass
class BlockDiagonalGappyKeysMask(_BlockDiagonal):
    """B18: block b's keys anywhere, [kv_seqstarts[b], kv_seqstarts[b] + kv_seqlen[b]); full attention."""

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _GappySeqInfo

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqstarts, kv_seqlen, *, device=None):
        return cls(
            q_seqinfo=_SeqLenInfo.from_seqlens(q_seqlen, device=device),
            k_seqinfo=_GappySeqInfo.from_seqlens_gappy(kv_seqstarts, kv_seqlen, device=device),
        )

    def make_paged(
        self,
        block_tables: torch.Tensor,
        page_size: int,
        notional_padding: int,
        paged_type: type[PagedBlockDiagonalGappyKeysMask],
    ) -> PagedBlockDiagonalGappyKeysMask:
        """These sequences with their keys read through the page table (B21, B22): sequence b's keys start
        kv_seqstarts[b] − b · notional_padding into lane b (the starts were laid out in lanes of notional_padding
        keys)."""
        if not (isinstance(paged_type, type) and issubclass(paged_type, PagedBlockDiagonalGappyKeysMask)):
            raise ValueError(f"make_paged: paged_type must be a paged gappy-keys mask (B21, B22), got {paged_type}")
        k = self.k_seqinfo
        starts = [start - b * notional_padding for b, start in enumerate(k.seqstart_py[:-1])]
        keys = _lane_keys(paged_type, starts, k.seqlen_py, block_tables, page_size, k.seqstart.device)
        return paged_type(self.q_seqinfo, keys, block_tables, page_size)


@dataclass
class BlockDiagonalCausalWithOffsetGappyKeysMask(_CausalFromBottomRight, BlockDiagonalGappyKeysMask):
    """B19: B18 and causal from the bottom right in each block."""


@dataclass
class BlockDiagonalLocalAttentionFromBottomRightGappyKeysMask(_LocalFromBottomRight, BlockDiagonalGappyKeysMask):
    """B20: B18 and −window_left <= j − i − s <= window_right in each block."""

    window_left: int
    window_right: int

    @classmethod
    def from_seqlens_local_gappy(cls, q_seqlen, kv_seqstarts, kv_seqlen, window_left, window_right, device=None):
        base = BlockDiagonalGappyKeysMask.from_seqlens(q_seqlen, kv_seqstarts, kv_seqlen, device=device)
        return cls(base.q_seqinfo, base.k_seqinfo, window_left, window_right)


# ------------------------------------------------------------------------------------ paged keys, B15-B17


def _lane_length(cls: type, block_tables, page_size) -> int:
    """max_pages · page_size, the logical keys of a lane, once block_tables is 2-D and page_size a positive int (a
    1-D table once failed on its missing dim with an IndexError)."""
    if not isinstance(block_tables, torch.Tensor) or block_tables.dim() != 2:
        got = tuple(block_tables.shape) if isinstance(block_tables, torch.Tensor) else type(block_tables).__name__
        raise ValueError(f"{cls.__name__}: block_tables must be int32 [B, max_pages], got {got}")
    if _int("page_size", page_size) < 1:
        raise ValueError(f"{cls.__name__}: page_size must be at least 1, got {page_size}")
    return block_tables.shape[1] * page_size


class _Paged(AttentionBias):
    """Keys read through a page table: logical key j of lane b (j < max_pages · page_size) is row
    block_tables[b, j // page_size] · page_size + j % page_size of a pool of pages. `_unpaged()` is the same
    mask over the logical keys laid out lane after lane."""

    q_seqinfo: _SeqLenInfo
    block_tables: torch.Tensor  # int32 [B, max_pages]: logical page -> physical page
    page_size: int

    def _check_table(self) -> None:
        batch = len(self.q_seqinfo.seqstart_py) - 1
        tables = self.block_tables
        _lane_length(type(self), tables, self.page_size)
        if tables.shape[0] != batch or tables.dtype != torch.int32:
            raise ValueError(
                f"{type(self).__name__}: block_tables must be int32 [B={batch}, max_pages], got "
                f"{tuple(tables.shape)} {tables.dtype}"
            )

    def _unpaged(self) -> AttentionBias:
        raise NotImplementedError

    def pool_rows(self, device) -> torch.Tensor:
        """int64 [lanes · max_pages · page_size]: the pool row of each logical key, lane after lane."""
        j = torch.arange(self.block_tables.shape[1] * self.page_size, device=device)
        pages = self.block_tables.to(device).long()[:, j // self.page_size]
        return (pages * self.page_size + j % self.page_size).flatten()

    def materialize(self, shape, dtype=torch.float32, device="cpu"):
        """[..., Mq, pool rows]: the unpaged mask's logical key columns moved to their physical rows (a row that
        several lanes share is allowed where any of them allows it). A page that one lane uses twice counts once
        here: attention over the logical keys (the reference backend's) counts it twice."""
        rows = self.pool_rows(device)
        pool = int(rows.max()) + 1 if rows.numel() else 0
        _check_materialized_shape(self, shape, self.q_seqinfo.seqstart_py[-1], pool)
        logical = self._unpaged().materialize((shape[-2], rows.numel()), dtype, device)
        out = torch.full((shape[-2], shape[-1]), -math.inf, dtype=dtype, device=device)
        out.scatter_reduce_(1, rows.reshape(1, -1).expand(shape[-2], -1), logical, "amax")
        return out.expand(*shape)

    def to(self, device):
        moved = ("q_seqinfo", "k_seqinfo", "block_tables")
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name in moved})


@dataclass
class PagedBlockDiagonalPaddedKeysMask(_Paged):
    """B15: B11 with the keys in pages (padding = max_pages · page_size)."""

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _PaddedSeqLenInfo
    block_tables: torch.Tensor
    page_size: int
    _UNPAGED: ClassVar[type] = BlockDiagonalPaddedKeysMask

    def __post_init__(self) -> None:
        self._check_table()
        if self.k_seqinfo.padding != self.block_tables.shape[1] * self.page_size:
            raise ValueError(
                f"{type(self).__name__}: the key padding {self.k_seqinfo.padding} must be max_pages · page_size = "
                f"{self.block_tables.shape[1]} · {self.page_size}"
            )

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen, block_tables, page_size, *, device=None, **window):
        padding = _lane_length(cls, block_tables, page_size)
        padded = BlockDiagonalPaddedKeysMask.from_seqlens(q_seqlen, padding, kv_seqlen, device=device)
        return cls(padded.q_seqinfo, padded.k_seqinfo, block_tables, page_size, **window)

    def _unpaged(self) -> BlockDiagonalPaddedKeysMask:
        paging = ("q_seqinfo", "k_seqinfo", "block_tables", "page_size")
        extra = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in paging}
        return self._UNPAGED(q_seqinfo=self.q_seqinfo, k_seqinfo=self.k_seqinfo, **extra)


@dataclass
class PagedBlockDiagonalCausalWithOffsetPaddedKeysMask(PagedBlockDiagonalPaddedKeysMask):
    """B16: B12 (bottom-right causal over the used keys), paged."""

    _UNPAGED: ClassVar[type] = BlockDiagonalCausalWithOffsetPaddedKeysMask


@dataclass
class PagedBlockDiagonalCausalLocalPaddedKeysMask(PagedBlockDiagonalPaddedKeysMask):
    """B17: B14 (bottom-right causal over a window of `_window_size` keys), paged."""

    _window_size: int
    _UNPAGED: ClassVar[type] = BlockDiagonalCausalLocalAttentionPaddedKeysMask

    def __post_init__(self) -> None:
        super().__post_init__()
        # (B14's check: a kernel would read 0 as no window)
        self._window_size = _check_window("window_size", self._window_size, 1)

    @classmethod
    def from_seqlens_local(cls, q_seqlen, kv_seqlen, block_tables, page_size, window_size, *, device=None):
        return cls.from_seqlens(q_seqlen, kv_seqlen, block_tables, page_size, device=device, _window_size=window_size)


@dataclass
class PagedBlockDiagonalGappyKeysMask(_Paged):
    """B21: lane b's keys are its logical keys [kv_seqstarts[b], kv_seqstarts[b] + kv_seqlen[b]) (starts inside
    the lane, one per lane), read through the page table; full attention. k_seqinfo has upstream's paged layout
    (_GappySeqInfo: the starts inside the lanes, the ends)."""

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _GappySeqInfo
    block_tables: torch.Tensor
    page_size: int
    _UNPAGED: ClassVar[type] = BlockDiagonalGappyKeysMask

    def __post_init__(self) -> None:
        self._check_table()

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqstarts, kv_seqlen, block_tables, page_size, *, device=None):
        keys = _lane_keys(cls, kv_seqstarts, kv_seqlen, block_tables, page_size, device)
        return cls(_SeqLenInfo.from_seqlens(q_seqlen, device=device), keys, block_tables, page_size)

    def _unpaged(self) -> BlockDiagonalGappyKeysMask:
        lane = self.block_tables.shape[1] * self.page_size
        return self._UNPAGED(q_seqinfo=self.q_seqinfo, k_seqinfo=self.k_seqinfo.lanes_laid_out(lane))


@dataclass
class PagedBlockDiagonalCausalWithOffsetGappyKeysMask(PagedBlockDiagonalGappyKeysMask):
    """B22: B21 and causal from the bottom right in each block."""

    _UNPAGED: ClassVar[type] = BlockDiagonalCausalWithOffsetGappyKeysMask


def _lane_keys(cls, kv_seqstarts, kv_seqlen, block_tables, page_size, device) -> _GappySeqInfo:
    """The keys of paged gappy masks (upstream's paged _GappySeqInfo): kv_seqstarts[b] is where sequence b's keys
    start inside lane b, and they must end inside it."""
    lane = _lane_length(cls, block_tables, page_size)
    starts, lengths = _ints("kv_seqstarts", kv_seqstarts), _ints("kv_seqlen", kv_seqlen)
    if len(starts) != len(lengths) or any(s < 0 or s + n > lane for s, n in zip(starts, lengths, strict=True)):
        raise ValueError(
            f"{cls.__name__}: kv_seqstarts (one per lane) and kv_seqlen must keep each sequence inside its lane "
            f"of {lane} keys, got {starts} and {lengths}"
        )
    return _GappySeqInfo.from_seqlens_gappy(starts, lengths, paged=True, device=device)


# Masks whose inputs are packed varlen batches (B = 1).
VARLEN_BIASES = (
    BlockDiagonalMask,
    BlockDiagonalGappyKeysMask,
    BlockDiagonalPaddedKeysMask,
    PagedBlockDiagonalPaddedKeysMask,
    PagedBlockDiagonalGappyKeysMask,
)
