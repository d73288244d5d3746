"""Reading ``torch.distributed.checkpoint`` (DCP) checkpoints as data, never as code.

DCP writes a checkpoint's ``.metadata`` with :mod:`pickle` and reads it back with
``pickle.load``; its default load planner reads the non-tensor entries (an optimizer's
``param_groups`` values: learning rates, betas, names) with ``torch.load(weights_only=False)``.
Both run whatever a crafted file asks for, on the machine that loads it. A checkpoint's own
digests cannot stop that: whoever writes the files writes the digests too.

Here both are read as data:

- :class:`DataReader`, a ``FileSystemReader`` whose ``.metadata`` goes through an unpickler that
  admits only the classes DCP's metadata is made of (:data:`METADATA_GLOBALS`, the dtypes of
  torch, ``torch.Size``, paths) and refuses any other global, so that nothing in the file runs;
- :class:`DataLoadPlanner`, DCP's default planner with the non-tensor entries read by
  ``torch.load(weights_only=True)`` (plain numbers, strings, lists, tuples, dicts, tensors).

A refused file raises :class:`RefusedCheckpoint` (a ``ValueError``) naming the file and what it
asked for. ``scaleopt train --resume`` reads every checkpoint this way (and falls back to the
newest earlier one that reads as data); users of DCP do the same with :func:`load`::

    import scaleopt.dcp
    scaleopt.dcp.load(state_dict, "run/checkpoints/step-00000200")
    # = dcp.load(state_dict, storage_reader=scaleopt.dcp.DataReader(path),
    #            planner=scaleopt.dcp.DataLoadPlanner())
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, Dict, FrozenSet, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["DataReader", "DataLoadPlanner", "RefusedCheckpoint", "read_metadata", "check", "load",
           "METADATA_GLOBALS"]

#: the globals a DCP ``.metadata`` file may name: DCP's own metadata classes, the pieces of
#: torch that describe a tensor, and the path types of the checkpoint's id (any ``torch.<name>``
#: that is a ``torch.dtype`` is admitted too)
METADATA_GLOBALS: FrozenSet[Tuple[str, str]] = frozenset(
    [("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
       ("torch", "Size"), ("torch.serialization", "_get_layout"),
       ("collections", "OrderedDict")]
    + [("pathlib", name) for name in (
        "Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")])


class RefusedCheckpoint(ValueError):
    """A checkpoint file that does not read as data: its pickle names a global that
    checkpoint metadata is not made of (code that would run on loading: ``asks_for_code``), or
    it is not a pickle of checkpoint metadata at all (a damaged file). The message names the
    file."""

    def __init__(self, message: str, asks_for_code: bool = True) -> None:
        super().__init__(message)
        self.asks_for_code = asks_for_code

    def __reduce__(self) -> Any:  # as DCP gathers a rank's error to the others
        return type(self), (str(self), self.asks_for_code)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, name: str) -> None:
        super().__init__(file)
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise RefusedCheckpoint(
            f"{self._name} asks to load {module}.{name}, which checkpoint metadata is not made "
            f"of (a file made to run code when it is read); nothing in it ran")

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedCheckpoint(f"{self._name} holds a persistent id, which checkpoint "
                                f"metadata does not")


def _unpickle_metadata(data: bytes, name: str) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), name).load()
    except RefusedCheckpoint:
        raise
    except Exception as exc:  # a truncated or foreign file: pickle's many errors
        raise RefusedCheckpoint(f"{name} is not checkpoint metadata ({type(exc).__name__}: "
                                f"{exc})", asks_for_code=False) from None
    if not isinstance(metadata, Metadata):
        raise RefusedCheckpoint(f"{name} is not checkpoint metadata (it holds a "
                                f"{type(metadata).__name__})", asks_for_code=False)
    return metadata


def _refused_entry(exc: Exception, what: str) -> RefusedCheckpoint:
    """The error for a non-tensor entry that ``torch.load(weights_only=True)`` did not take:
    one that asks for a global (code), or one that cannot be read at all (damage)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    asked = next((line for line in lines if "global" in line.lower()), None)
    if asked is None:
        return RefusedCheckpoint(f"{what} cannot be read ({type(exc).__name__}"
                                 f"{': ' + lines[0] if lines else ''})", asks_for_code=False)
    return RefusedCheckpoint(f"{what} does not read as data ({asked}); nothing in it ran")


def read_metadata(path: Union[str, os.PathLike]) -> Metadata:
    """The ``Metadata`` of the DCP checkpoint folder ``path``, read as data
    (:class:`RefusedCheckpoint` where its ``.metadata`` names anything else)."""
    return DataReader(path).read_metadata()


def check(path: Union[str, os.PathLike]) -> Metadata:
    """Read the checkpoint folder ``path`` as :func:`load` would, before loading anything: its
    ``.metadata`` (:func:`read_metadata`) and every non-tensor entry (``weights_only``, as
    :class:`DataLoadPlanner` reads them); its metadata, or :class:`RefusedCheckpoint` naming
    the file and the entry. (Tensor entries are read by DCP with ``weights_only=True``.)"""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_metadata(path)
    for index, info in (metadata.storage_data or {}).items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if getattr(info, "transform_descriptors", None):
            continue  # stored transformed: read (as data) by DataLoadPlanner when loaded
        name = os.path.join(os.fspath(path), info.relative_path)
        with open(name, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except Exception as exc:
            raise _refused_entry(exc, f"{name}: the checkpoint entry {index.fqn!r}") from None
    return metadata


class DataReader(FileSystemReader):
    """``torch.distributed.checkpoint.FileSystemReader`` that reads ``.metadata`` as data: only
    the classes of :data:`METADATA_GLOBALS` (and torch's dtypes) are built; a file that names
    any other global raises :class:`RefusedCheckpoint` before anything in it runs."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _unpickle_metadata(f.read(), str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with the checkpoint's non-tensor entries (an optimizer's
    hyperparameters, its parameters' names) read by ``torch.load(weights_only=True)``: numbers,
    strings, containers and tensors, no other object. :class:`RefusedCheckpoint` names the
    entry otherwise."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise _refused_entry(exc, f"the checkpoint entry {fqn!r}") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # as DCP's planner

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load(state_dict: Dict[str, Any], checkpoint_id: Union[str, os.PathLike],
         process_group: Optional[Any] = None) -> None:
    """``torch.distributed.checkpoint.load(state_dict, checkpoint_id=...)`` with the checkpoint
    read as data (:class:`DataReader`, :class:`DataLoadPlanner`): in place, on every rank.
    :class:`RefusedCheckpoint` itself where a file or an entry does not read as data (not
    DCP's wrapper of it); DCP's ``CheckpointException`` for other failures."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    read_metadata(checkpoint_id)  # a crafted .metadata refused here, by its own error
    try:
        dcp.load(state_dict, storage_reader=DataReader(checkpoint_id),
                 planner=DataLoadPlanner(), process_group=process_group)
    except CheckpointException as exc:
        for failure, _ in exc.failures.values():
            if isinstance(failure, RefusedCheckpoint):
                raise failure from None
        raise
