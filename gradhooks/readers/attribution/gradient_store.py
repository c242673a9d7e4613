"""A projected gradient store: the ``(N, K)`` projected per-sample gradients of a whole data set
on disk, written batch by batch, resumable, and scored against queries (LoGra: Choe et al. 2024,
arXiv:2405.13954, sec. 3-4; TRAK: Park et al. 2023, arXiv:2303.14186, sec. 3; LESS: Xia et al.
2024, arXiv:2402.04333, sec. 3).

Index conventions: ``n`` train sample (``N`` rows of the store), ``m`` query sample (``M``),
``k`` projected coordinate (``K = k_in k_out`` per linear layer and per other parameter,
:func:`~gradhooks.readers.attribution.projections.project_features`' order).

On disk, a folder::

    grads.npy         (N, K) float16, float32 or float64, a standard .npy (numpy.lib.format.open_memmap)
    out_to_loss.npy   (N,) float32, TRAK's Q = 1 - p per sample (only when written)
    keys.npy          (N, 2) int64, each row's (sample index, training step) (only when written:
                      a store written during training, gradhooks.integrations.store_callback)
    meta.json         the spec (k_in, k_out, seed, dtype, N, output, transform, the layers and
                      their projected widths, K) and how many rows are written

Rows are written in order; each batch is flushed to the file before ``meta.json`` (replaced
atomically) counts it, so a store interrupted at any point reopens at its first row not known
to be written. Reopening a folder with the same spec continues there; a different spec raises
:class:`StoreSpecError` naming each field that differs.

Scores (:meth:`GradientStore.scores`), ``Φ`` the store ``(N, K)``, ``q`` the queries ``(M, K)``
projected with the same spec::

    S = q Φ^T                                   (TracIn / LoGra / LESS inner products)
    S = q (Φ^T Φ + λ I)^{-1} Φ^T  [· diag(Q)]   (TRAK, sec. 3, eq. (13) with its ridge λ
                                                 and out-to-loss weights Q)

formed a chunk of rows of ``Φ`` at a time; ``Φ^T Φ`` ``(K, K)`` is accumulated in float64.
"""
from __future__ import annotations

import importlib
import json
import math
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ...base.errors import GradHooksError
from ..gram import GradientFeatures
from .output_functions import GradientTransform, ProjectionCache, project_batch

if TYPE_CHECKING:
    import numpy as np

__all__ = ["GradientStore", "StoreSpecError", "DTYPES", "CHUNK_ROWS"]


def _np():
    # numpy only for the store's files (``.npy`` memory maps): ``import gradhooks`` needs torch
    # and opt_einsum alone.
    return importlib.import_module("numpy")


#: Storage dtypes: name -> (torch dtype, numpy dtype name).
DTYPES = {"float16": (torch.float16, "float16"), "float32": (torch.float32, "float32"),
          "float64": (torch.float64, "float64")}
#: Rows of the store read at a time when scoring or forming ``Φ^T Φ``.
CHUNK_ROWS = 8192
_FORMAT = 1
_SPEC_FIELDS = ("size", "k_in", "k_out", "seed", "dtype", "output", "transform")
#: Optional per-row columns beside grads.npy: name -> (numpy dtype, shape of a row, given as).
_SIDE = {"out_to_loss": ("float32", (), "out_to_loss"),
         "keys": ("int64", (2,), "sample_index and step")}


class StoreSpecError(GradHooksError, ValueError):
    """A store folder was opened with a spec other than the one it was written with (projection
    sizes, seed, dtype, N, output function, transform, or the model's layers), or a batch does
    not fit the store (its width ``K``, rows past ``N``). The message names each difference and
    what to do (the same arguments, ``overwrite=True``, or another folder)."""


def _dtype_name(dtype) -> str:
    for name, (t, n) in DTYPES.items():
        if dtype in (t, n, name) or getattr(dtype, "__name__", None) == name:  # (numpy's)
            return name
    raise GradHooksError(f"GradientStore: dtype must be torch.float16, torch.float32 or "
                         f"torch.float64, got {dtype!r}")


class GradientStore:
    """``(N, K)`` projected per-sample gradients of a data set in a memory-mapped ``.npy`` file,
    written in chunks, resumable (module docstring).

    Typical use (LoGra / TRAK / LESS)::

        store = GradientStore("grads/", size=len(train_set), k_in=16, k_out=16, seed=0)
        with gradhooks.attach(model, loss_reduction="sum") as gh:
            store.fill(gh, train_loader, lambda model, batch: per_sample_losses)   # resumable
            gh.backward(per_sample_query_losses.sum())
            query = store.project(gh.gradient_features())                  # (M, K)
        scores = store.scores(query)                                       # (M, N)

    Args:
        path: the store's folder (created if missing).
        size: ``N``, the number of samples (rows).
        k_in, k_out: the LoGra projection sizes of each layer's input and output side
            (:func:`~gradhooks.readers.attribution.projections.projected_grads`; ``K = k_in k_out`` per
            layer and per other parameter).
        seed: selects the projections (:func:`~gradhooks.readers.attribution.projections.projection`);
            queries must be projected with the same.
        dtype: ``torch.float16`` (default; half the disk, relative rounding ``2**-11``),
            ``torch.float32``, or ``torch.float64`` (for exact comparisons).
        output: a label of what was differentiated, recorded and compared on reopening
            (``"loss"``, ``"margin"`` for TRAK's :func:`~gradhooks.readers.attribution.output_functions.trak_margins`,
            or your own).
        transform: a label of the per-sample transform (``None``, ``"adam"`` for LESS's
            :class:`~gradhooks.readers.attribution.output_functions.AdamDirection`), recorded and compared.
        overwrite: delete an existing store in ``path`` instead of resuming it.

    Raises:
        StoreSpecError: if ``path`` holds a store written with another spec (and not
            ``overwrite``); the message lists each field that differs.
        GradHooksError: on ``size < 0``, ``k_in`` / ``k_out`` below 1, another dtype, or a
            ``path`` that is a file.
    """

    def __init__(self, path: Union[str, os.PathLike], size: int, *, k_in: int = 16, k_out: int = 16,
                 seed: int = 0, dtype=torch.float16, output: str = "loss",
                 transform: Optional[str] = None, overwrite: bool = False):
        if int(size) != size or size < 0:
            raise GradHooksError(f"GradientStore: size must be a non-negative int, got {size!r}")
        if k_in < 1 or k_out < 1:
            raise GradHooksError(f"GradientStore: k_in and k_out must be positive, got {k_in}, {k_out}")
        self.path = os.fspath(path)
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise GradHooksError(f"GradientStore: {self.path!r} is a file; the store is a folder")
        self.spec: Dict[str, Any] = {"size": int(size), "k_in": int(k_in), "k_out": int(k_out),
                                     "seed": int(seed), "dtype": _dtype_name(dtype),
                                     "output": str(output),
                                     "transform": None if transform is None else str(transform)}
        self.layers: Optional[Dict[str, int]] = None
        self.rows, self.dim = 0, None
        self._array = None
        self._side: Dict[str, Any] = dict.fromkeys(_SIDE)  # name -> memory map or None
        self.cache = ProjectionCache(int(seed))
        if overwrite and os.path.isdir(self.path):
            for name in ("grads.npy", *(f"{k}.npy" for k in _SIDE), "meta.json"):
                if os.path.exists(os.path.join(self.path, name)):
                    os.remove(os.path.join(self.path, name))
        os.makedirs(self.path, exist_ok=True)
        if os.path.exists(self._file("meta.json")):
            self._reopen()
        else:
            self._save_meta()

    # ------------------------------------------------------------------------------ metadata
    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _save_meta(self) -> None:
        meta = dict(self.spec, format=_FORMAT, layers=self.layers, dim=self.dim, rows=self.rows,
                    **{f"has_{k}": v is not None for k, v in self._side.items()})
        tmp = self._file("meta.json.tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._file("meta.json"))

    def _reopen(self) -> None:
        with open(self._file("meta.json")) as f:
            meta = json.load(f)
        diff = [f"{k}: stored {meta.get(k)!r}, given {self.spec[k]!r}" for k in _SPEC_FIELDS
                if meta.get(k) != self.spec[k]]
        if diff:
            raise StoreSpecError(
                f"GradientStore: {self.path!r} was written with another spec ({'; '.join(diff)}). "
                f"Open it with the stored values to resume, pass overwrite=True to start again, or "
                f"use another folder")
        self.layers, self.dim, self.rows = meta["layers"], meta["dim"], int(meta["rows"])
        if self.dim is not None:
            self._array = _np().load(self._file("grads.npy"), mmap_mode="r+")
            if self._array.shape != (self.spec["size"], self.dim):
                raise StoreSpecError(f"GradientStore: {self._file('grads.npy')} has shape "
                                     f"{self._array.shape}, meta.json says {(self.spec['size'], self.dim)}: "
                                     f"the folder is damaged; pass overwrite=True")
        for k in _SIDE:
            if meta.get(f"has_{k}"):
                self._side[k] = _np().load(self._file(f"{k}.npy"), mmap_mode="r+")

    def _layers_of(self, features: GradientFeatures) -> Dict[str, int]:
        # {layer or parameter: its projected width}, in the store's column order.
        ki, ko = self.spec["k_in"], self.spec["k_out"]
        out = {path: e.a.shape[1] * ki * ko for path, e in features.linear.items()}
        out.update({name: ki * ko for name in features.dense})
        return out

    def _create(self, layers: Optional[Dict[str, int]], dim: int) -> None:
        # layers: None when the first rows came as a tensor (then never compared)
        self.layers, self.dim = layers, dim
        self._array = _memmap(self._file("grads.npy"), DTYPES[self.spec["dtype"]][1],
                              (self.spec["size"], self.dim))
        self._save_meta()

    # ------------------------------------------------------------------------------- writing
    @property
    def size(self) -> int:
        """``N``, the rows the store holds when complete."""
        return self.spec["size"]

    @property
    def complete(self) -> bool:
        """Whether all ``N`` rows are written."""
        return self.rows >= self.size

    def project(self, features: GradientFeatures, *, transform: Optional[GradientTransform] = None,
                model=None) -> Tensor:
        """``(B, K)`` projected per-sample gradients of a batch with this store's projections
        (:func:`~gradhooks.readers.attribution.output_functions.project_batch`, matrices cached): the train
        rows :meth:`add` takes, or the queries :meth:`scores` takes (LESS projects the queries'
        plain gradients: no transform).

        Raises:
            StoreSpecError: if the features' layers differ from those the store was written with.
        """
        layers = self._layers_of(features)
        if self.layers is not None and layers != self.layers:
            _layer_mismatch(self.path, self.layers, layers)
        return project_batch(features, self.spec["k_in"], self.spec["k_out"], self.spec["seed"],
                             transform=transform, model=model, cache=self.cache)

    def add(self, rows: Union[Tensor, GradientFeatures], out_to_loss: Optional[Tensor] = None, *,
            transform: Optional[GradientTransform] = None, model=None,
            sample_index: Optional[Tensor] = None, step: Optional[int] = None) -> int:
        """Write the next ``B`` rows and count them in ``meta.json``.

        Args:
            rows: ``(B, K)`` projected gradients (:meth:`project`), or the batch's
                :class:`~gradhooks.readers.gram.GradientFeatures` (projected here, with
                ``transform`` and ``model`` as :meth:`project`).
            out_to_loss: ``(B,)`` TRAK's ``Q`` of the batch, or ``None``; once given, every
                batch must give it.
            sample_index, step: the rows' keys (for every batch or none): ``(B,)`` the
                samples' indices in the data set and the training step (an int) the gradients
                were taken at (:mod:`gradhooks.integrations.store_callback`); read back as
                :attr:`sample_index` and :attr:`steps`.

        Returns:
            The number of rows written so far.

        Raises:
            StoreSpecError: if ``K`` differs from the store's, the rows would pass ``N``,
                ``out_to_loss`` or the keys are given for some batches only, or
                ``sample_index`` is not ``(B,)``.
            GradHooksError: if a float16 store would hold an infinite or NaN value (use
                ``dtype=torch.float32``).
        """
        layers = None
        if isinstance(rows, GradientFeatures):
            layers = self._layers_of(rows)
            rows = self.project(rows, transform=transform, model=model)
        return self._write(rows, out_to_loss, layers, _keys(sample_index, step, rows.shape[0]))

    def _write(self, rows: Tensor, out_to_loss: Optional[Tensor],
               layers: Optional[Dict[str, int]], keys: Optional[Tensor] = None) -> int:
        if rows.dim() != 2:
            raise StoreSpecError(f"GradientStore.add(): rows must be (B, K), got {tuple(rows.shape)}")
        b = rows.shape[0]
        if self.rows + b > self.size:
            raise StoreSpecError(f"GradientStore.add(): {b} rows after {self.rows} pass the store's "
                                 f"N = {self.size}; create it with the data set's size")
        if self.dim is None:
            self._create(layers, int(rows.shape[1]))
        if rows.shape[1] != self.dim:
            raise StoreSpecError(f"GradientStore.add(): rows have K = {rows.shape[1]}, the store "
                                 f"{self.dim} (other k_in / k_out, or other layers)")
        side = {"out_to_loss": None if out_to_loss is None else
                out_to_loss.detach().reshape(b).to("cpu", torch.float32), "keys": keys}
        for k, v in side.items():
            if (v is None) != (self._side[k] is None) and self.rows > 0:
                raise StoreSpecError(f"GradientStore.add(): {_SIDE[k][2]} must be given for every "
                                     f"batch or for none")
        if b == 0:
            return self.rows
        data = rows.detach().to("cpu", DTYPES[self.spec["dtype"]][0])
        if self.spec["dtype"] == "float16" and not bool(torch.isfinite(data).all()):
            raise GradHooksError("GradientStore.add(): a projected gradient overflows float16 "
                                 "(|x| > 65504) or is NaN; use dtype=torch.float32")
        self._array[self.rows:self.rows + b] = data.numpy()
        self._array.flush()
        _append_side(self._side, side, self.path, self.size, self.rows)
        self.rows += b
        self._save_meta()
        return self.rows

    def fill(self, gh, loader: Iterable, output_fn: Callable, *,
             transform: Optional[GradientTransform] = None, progress: bool = True) -> "GradientStore":
        """Write the projected per-sample gradients of every sample of ``loader``, batch by
        batch, from the first row not yet written (batches wholly written are skipped without a
        forward; a batch written in part has its remaining rows written).

        Args:
            gh: the :class:`~gradhooks.GradHooks` attached to the model.
            loader: an iterable of batches, in the same order on every run (no shuffling), of
                ``N`` samples in all.
            output_fn: ``output_fn(model, batch)`` -> per-sample outputs ``(B,)`` to
                differentiate (each sample's loss; TRAK's margins,
                :func:`~gradhooks.readers.attribution.output_functions.margin_output`), or a pair
                ``(outputs, out_to_loss)`` with TRAK's ``Q`` ``(B,)``. They are reduced as
                ``gh.loss_reduction`` says and backpropagated with ``gh.backward``; row ``n``
                is the gradient of ``outputs[n]`` alone.
            transform: a per-sample transform before the projection (LESS:
                :class:`~gradhooks.readers.attribution.output_functions.AdamDirection`).
            progress: a ``tqdm`` bar when tqdm is installed.

        Returns:
            ``self``.

        Raises:
            StoreSpecError: as :meth:`add`, or if ``output_fn`` returns other than ``(B,)``.
            GradHooksError: if the loader gives fewer than ``N`` samples.
        """
        bar = _progress(self.size, self.rows, progress)
        seen = 0
        try:
            for batch in loader:
                if self.complete:
                    break
                b = _batch_size(batch)
                if seen + b <= self.rows:
                    seen += b
                    continue
                skip = self.rows - seen
                self._add_batch(gh, batch, output_fn, transform, skip)
                seen += b
                if bar is not None:
                    bar.update(b - skip)
        finally:
            if bar is not None:
                bar.close()
        if not self.complete:
            raise GradHooksError(f"GradientStore.fill(): the loader gave {seen} samples, the store "
                                 f"holds N = {self.size} ({self.rows} written)")
        return self

    def add_batch(self, gh, batch, output_fn: Callable, *,
                  transform: Optional[GradientTransform] = None) -> int:
        """Write one batch's rows (what :meth:`fill` does per batch, for your own loop):
        ``output_fn(gh.model, batch)``, ``gh.backward``, the projection, the write; the
        records are cleared after. Arguments, errors: as :meth:`fill` and :meth:`add`.

        Returns:
            The number of rows written so far.
        """
        return self._add_batch(gh, batch, output_fn, transform, 0)

    def _add_batch(self, gh, batch, output_fn, transform, skip: int) -> int:
        # rows skip: of the batch (the first ones are already written when resuming mid-batch)
        if _batch_size(batch) == 0:
            return self.rows
        out = output_fn(gh.model, batch)
        q = None
        if isinstance(out, (tuple, list)):
            out, q = out
        if out.dim() != 1:
            raise StoreSpecError(f"GradientStore.fill(): output_fn must return per-sample outputs "
                                 f"(B,), got {tuple(out.shape)}")
        gh.backward(out.sum() if gh.loss_reduction == "sum" else out.mean())
        try:
            feats = gh.gradient_features()
            rows = self.project(feats, transform=transform, model=gh.model)
        finally:
            gh.clear()
        return self._write(rows[skip:], None if q is None else q[skip:], self._layers_of(feats))

    # ------------------------------------------------------------------------------- reading
    @property
    def array(self) -> np.ndarray:
        """The ``(N, K)`` memory map itself (rows past :attr:`rows` are zeros / unwritten)."""
        self._need_rows("array")
        return self._array

    @property
    def out_to_loss(self) -> Optional[Tensor]:
        """TRAK's ``Q`` ``(rows,)`` float32, or ``None`` if no batch gave it."""
        return self._column("out_to_loss")

    @property
    def sample_index(self) -> Optional[Tensor]:
        """``(rows,)`` int64 sample indices (:meth:`add`'s), or ``None`` if none were given."""
        return self._column("keys", 0)

    @property
    def steps(self) -> Optional[Tensor]:
        """``(rows,)`` int64 training steps (:meth:`add`'s), or ``None`` if none were given."""
        return self._column("keys", 1)

    def _column(self, name: str, *col: int) -> Optional[Tensor]:
        v = self._side[name]
        return None if v is None else torch.from_numpy(_np().array(v[(slice(self.rows), *col)]))

    def truncate(self, rows: int) -> None:
        """Forget the rows from ``rows`` on (the next :meth:`add` writes there; a training run
        resumed from a checkpoint redoes the steps after it). Raises GradHooksError if ``rows``
        is not in ``[0, self.rows]``."""
        if int(rows) != rows or not 0 <= rows <= self.rows:
            raise GradHooksError(f"GradientStore.truncate(): rows must be in [0, {self.rows}], "
                                 f"got {rows!r}")
        self.rows = int(rows)
        self._save_meta()

    def features(self, start: int = 0, stop: Optional[int] = None, dtype=torch.float32) -> Tensor:
        """Rows ``start:stop`` (default: all written) as a ``(stop - start, K)`` tensor (a copy,
        in ``dtype``)."""
        self._need_rows("features()")
        stop = self.rows if stop is None else min(int(stop), self.rows)
        return torch.from_numpy(_np().array(self._array[int(start):stop])).to(dtype)

    def _need_rows(self, who: str) -> None:
        if self._array is None:
            raise GradHooksError(f"GradientStore.{who}: nothing written yet in {self.path!r}")

    def _chunks(self, dtype) -> Iterable[Tuple[int, Tensor]]:
        for lo in range(0, self.rows, CHUNK_ROWS):
            yield lo, self.features(lo, lo + CHUNK_ROWS, dtype)

    def kernel(self) -> Tensor:
        """``Φ^T Φ`` ``(K, K)`` float64 over the written rows (TRAK's ``X^T X``), accumulated a
        chunk of :data:`CHUNK_ROWS` rows at a time."""
        self._need_rows("kernel()")
        total = torch.zeros(self.dim, self.dim, dtype=torch.float64)
        for _, phi in self._chunks(torch.float64):
            total += phi.T @ phi
        return total

    def scores(self, query: Tensor, *, damping: Optional[float] = None, out_to_loss: bool = False,
               kernel: Optional[Tensor] = None) -> Tensor:
        """Scores of every written train row on each query (module docstring).

        Args:
            query: ``(M, K)`` projected query gradients, same spec (:meth:`project`).
            damping: ``None``: plain inner products ``q Φ^T`` (TracIn, LoGra, LESS's cosine
                after normalising both sides). A float ``λ >= 0``: TRAK's
                ``q (Φ^T Φ + λ I)^{-1} Φ^T`` (``λ = 0``, traker's default, needs ``N >= K``
                and ``Φ`` of full rank).
            out_to_loss: multiply column ``n`` by TRAK's ``Q_n`` (needs them written).
            kernel: ``Φ^T Φ`` if already formed (:meth:`kernel`), to reuse across calls.

        Returns:
            ``(M, rows)`` in ``query``'s dtype when float64, else float32.

        Raises:
            GradHooksError: if ``query`` is not ``(M, K)``, ``out_to_loss`` without stored
                weights, or ``Φ^T Φ + λ I`` is singular (raise ``damping``).
        """
        self._need_rows("scores()")
        if query.dim() != 2 or query.shape[1] != self.dim:
            raise GradHooksError(f"GradientStore.scores(): query must be (M, {self.dim}), got "
                                 f"{tuple(query.shape)}; project it with store.project(...)")
        dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        q = query.detach().to("cpu", torch.float64)
        if damping is not None:
            if damping < 0 or not math.isfinite(damping):
                raise GradHooksError(f"GradientStore.scores(): damping must be >= 0, got {damping}")
            xtx = (self.kernel() if kernel is None else kernel.to(torch.float64)).clone()
            xtx.diagonal().add_(damping)
            chol, info = torch.linalg.cholesky_ex(xtx)
            if int(info) != 0:
                raise GradHooksError(
                    f"GradientStore.scores(): Φ^T Φ + {damping} I is singular (N = {self.rows}, "
                    f"K = {self.dim}); pass a larger damping")
            q = torch.cholesky_solve(q.T, chol).T
        q = q.to(dtype)
        out = torch.empty(q.shape[0], self.rows, dtype=dtype)
        for lo, phi in self._chunks(dtype):
            out[:, lo:lo + phi.shape[0]] = q @ phi.T
        if out_to_loss:
            if self._side["out_to_loss"] is None:
                raise GradHooksError("GradientStore.scores(out_to_loss=True): no out_to_loss was "
                                     "written; fill with output_fn returning (outputs, Q)")
            out *= self.out_to_loss.to(dtype)
        return out

    def __repr__(self) -> str:
        return (f"GradientStore({self.path!r}, rows={self.rows}/{self.size}, K={self.dim}, "
                f"k_in={self.spec['k_in']}, k_out={self.spec['k_out']}, seed={self.spec['seed']}, "
                f"dtype={self.spec['dtype']}, output={self.spec['output']!r}, "
                f"transform={self.spec['transform']!r})")


def _layer_mismatch(path: str, stored: Dict[str, int], layers: Dict[str, int]) -> None:
    missing = [k for k in stored if k not in layers]
    extra = [k for k in layers if k not in stored]
    width = [f"{k}: {stored[k]} vs {layers[k]}" for k in layers if k in stored and stored[k] != layers[k]]
    raise StoreSpecError(
        f"GradientStore: the batch's layers differ from those {path!r} was written with "
        f"(missing {missing}, extra {extra}, widths {width}; order "
        f"{'same' if list(layers) == list(stored) else 'differs'}). Freeze / unfreeze "
        f"the same parameters as when the store was started, or use another folder")


def _memmap(file: str, dtype: str, shape: Tuple[int, ...]):
    return _np().lib.format.open_memmap(file, mode="w+", dtype=dtype, shape=shape)


def _append_side(columns: Dict[str, Any], values: Dict[str, Optional[Tensor]], folder: str,
                 size: int, at: int) -> None:
    # Write each given side column's rows from row ``at`` (its file created at first use).
    for k, v in values.items():
        if v is not None:
            if columns[k] is None:
                columns[k] = _memmap(os.path.join(folder, f"{k}.npy"), _SIDE[k][0], (size, *_SIDE[k][1]))
            columns[k][at:at + v.shape[0]] = v.numpy()
            columns[k].flush()


def _keys(sample_index, step, b: int) -> Optional[Tensor]:
    # (B, 2) int64 [sample index, step] of add()'s keys, or None.
    if (sample_index is None) != (step is None):
        raise StoreSpecError("GradientStore.add(): give sample_index and step together")
    if sample_index is None:
        return None
    index = torch.as_tensor(sample_index, dtype=torch.int64).cpu().reshape(-1)
    if index.shape[0] != b:
        raise StoreSpecError(f"GradientStore.add(): {index.shape[0]} sample indices for {b} rows")
    return torch.stack([index, torch.full_like(index, int(step))], 1)


def _batch_size(batch) -> int:
    # The samples in a batch: the first dim of its first tensor (a tensor, a tuple / list, or a
    # dict of tensors).
    first = batch
    while not isinstance(first, Tensor):
        if isinstance(first, dict):
            first = next(iter(first.values()))
        elif isinstance(first, Sequence) and len(first):
            first = first[0]
        else:
            raise GradHooksError(f"GradientStore.fill(): cannot tell the batch size of a "
                                 f"{type(batch).__name__}; give batches of tensors")
    return int(first.shape[0])


def _progress(total: int, done: int, wanted: bool):
    if not wanted:
        return None
    try:
        tqdm = importlib.import_module("tqdm").tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=done, unit="sample", desc="gradient store")
