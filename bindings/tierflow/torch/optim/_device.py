"""The host side of parameters that live on a CUDA device, for an optimizer
whose step runs on the CPU (ZeRO-Offload for one GPU).

Each such parameter has an *image* in pinned host memory: its values, which
the CPU step reads and writes (the fp32 master itself for an fp32
parameter; the bf16/fp16 copy the kernel writes from the master for a
low-precision one), and a pinned buffer its gradient comes down into. One
step goes:

1. ``begin``: wait (on the CPU) for the last step's uploads to have read the
   images, which the step is about to write; both copy streams wait for the
   work queued so far on the compute (current) stream, which made the
   gradients and still reads the parameters; every gradient's download is
   queued on the download stream, a mark recorded after each bucket's.
2. per bucket, in order: ``wait`` for its mark (the CPU blocks only until
   that bucket's gradients are down, so the step of one bucket overlaps the
   downloads of the next), the CPU step on its images, ``upload`` of the
   images stepped, queued on the upload stream (overlapping the next
   bucket's step).
3. ``end``: the compute stream waits for both copy streams, so whatever is
   queued on it next reads the updated parameters. Nothing blocks the CPU:
   step() returns once the uploads are queued.

A :class:`CudaLink` does the queueing on two CUDA streams of the device. The
protocol needs only the link's eight operations (:class:`Link`), so a link
over CPU tensors, whose copies wait in queues until a mark is waited for,
stands in for it where there is no GPU and records their order
(tests/python/test_adam_cuda.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

__all__ = ["BUCKET_BYTES", "Bucket", "CudaLink", "DeviceParams", "Link", "link_for", "on_device"]

# Gradients are waited for in buckets of at least this many bytes (a larger
# parameter is a bucket of its own): few enough marks and C++ calls for a
# model of many small tensors, small enough that the first bucket's download,
# the one the step cannot overlap, is short (0.7 ms at 25 GB/s).
BUCKET_BYTES = 16 << 20


def on_device(p: Tensor) -> bool:
    """Whether p goes through the device path: a parameter on a CUDA device."""
    return p.device.type == "cuda"


class Link(Protocol):
    """The copies and marks of one device, in the order of its queues."""

    pin_memory: bool  # whether host buffers are allocated pinned

    def fetch(self, dst: Tensor, src: Tensor) -> None:
        """Copies device tensor src into host dst now (the CPU waits)."""

    def begin(self) -> None:
        """Downloads and uploads queued from here on follow the work queued
        on the compute stream so far."""

    def download(self, dst: Tensor, src: Tensor) -> None:
        """Queues the copy of device tensor src into host buffer dst."""

    def downloaded(self) -> object:
        """A mark that passes once the downloads queued so far are done."""

    def upload(self, dst: Tensor, src: Tensor) -> None:
        """Queues the copy of host buffer src into device tensor dst."""

    def uploaded(self) -> object:
        """A mark that passes once the uploads queued so far are done."""

    def wait(self, mark: object) -> None:
        """Blocks the CPU until `mark` passed."""

    def end(self) -> None:
        """Makes the compute stream wait for every copy queued so far."""


class CudaLink:
    """A CUDA device's link: downloads on one stream, uploads on another (two
    copy engines work at once on most GPUs), each ordered after the compute
    stream's work by a wait on the device, never on the CPU."""

    pin_memory = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._download = torch.cuda.Stream(device)
        self._upload = torch.cuda.Stream(device)

    def fetch(self, dst: Tensor, src: Tensor) -> None:
        # On the compute stream, blocking: ordered after what wrote src.
        dst.copy_(src)

    def begin(self) -> None:
        compute = torch.cuda.current_stream(self.device)
        self._download.wait_stream(compute)  # the gradients are complete
        self._upload.wait_stream(compute)  # and the parameters no longer read

    def download(self, dst: Tensor, src: Tensor) -> None:
        # Into pinned memory, so truly asynchronous. torch's copy records the
        # pinned block's use, so it is not reused before the copy is done.
        with torch.cuda.stream(self._download):
            dst.copy_(src, non_blocking=True)

    def downloaded(self) -> torch.cuda.Event:
        # blocking=True: the CPU sleeps in wait() rather than spinning a core
        # the step's own threads could use.
        mark = torch.cuda.Event(blocking=True)
        mark.record(self._download)
        return mark

    def upload(self, dst: Tensor, src: Tensor) -> None:
        with torch.cuda.stream(self._upload):
            dst.copy_(src, non_blocking=True)

    def uploaded(self) -> torch.cuda.Event:
        mark = torch.cuda.Event(blocking=True)
        mark.record(self._upload)
        return mark

    def wait(self, mark: torch.cuda.Event) -> None:
        mark.synchronize()  # (torch releases the GIL meanwhile)

    def end(self) -> None:
        # The download stream too: after an error in the middle of a step,
        # gradients still being read must not be freed and reused under it.
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self._upload)
        compute.wait_stream(self._download)


def link_for(device: torch.device) -> Link:
    """The link of a device that on_device() parameters live on."""
    return CudaLink(device)


class _HostCopy:
    """A device parameter's buffers in host memory, and the storage they were
    made for (a parameter whose storage moved gets new ones)."""

    __slots__ = ("image", "grad", "address", "shape", "dtype")

    def __init__(self, p: Tensor, image: Tensor) -> None:
        self.image, self.grad = image, None
        self.address, self.shape, self.dtype = p.data_ptr(), p.shape, p.dtype

    def fits(self, p: Tensor) -> bool:
        return p.data_ptr() == self.address and p.shape == self.shape and p.dtype == self.dtype


class Bucket:
    """Parameters of one param group whose gradients are waited for at once."""

    __slots__ = ("group", "params", "mark")

    def __init__(self, group: int, params: list[Tensor], mark: object) -> None:
        self.group, self.params, self.mark = group, params, mark


class DeviceParams:
    """The images and gradient buffers of the device parameters of one
    optimizer, all on one device, and the protocol of a step over them (the
    module's docstring)."""

    def __init__(self, link: Link, bucket_bytes: int | None = None) -> None:
        self.link = link
        self.bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self._copies: dict[Tensor, _HostCopy] = {}
        self._uploaded: object | None = None  # the mark the last step's uploads end with

    def _copy_of(self, p: Tensor) -> _HostCopy:
        copy = self._copies.get(p)
        if copy is None or not copy.fits(p):
            # A new buffer, never the old one: an upload from it may still be queued.
            image = torch.empty(p.shape, dtype=p.dtype, pin_memory=self.link.pin_memory)
            self.link.fetch(image, p.detach())
            copy = self._copies[p] = _HostCopy(p, image)
        return copy

    def image(self, p: Tensor) -> Tensor:
        """p's values in host memory (contiguous, p's shape and dtype): what
        the CPU step reads and writes for p. Made by a download when p is
        first met or its storage moved; after that, what was last uploaded to
        p. Read it freely; write it only through a step."""
        return self._copy_of(p).image

    def forget(self) -> None:
        """Drops every image: the next use reads each parameter again (after
        the parameters were written outside a step, as by loading weights).
        The compute stream already waits for the last uploads (end()), so a
        read queued on it sees them."""
        self._copies.clear()

    def grad(self, p: Tensor) -> Tensor:
        """The host buffer p's gradient came down into at begin()."""
        return self._copies[p].grad

    def begin(self, groups: list[tuple[int, list[Tensor]]]) -> list[Bucket]:
        """Queues the download of every gradient of `groups` ((param group
        index, parameters with a gradient) pairs) and returns the buckets, in
        order, each with the mark its gradients are down at."""
        if self._uploaded is not None:
            self.link.wait(self._uploaded)  # (normally long passed: the forward pass ran since)
            self._uploaded = None
        copies = [[self._copy_of(p) for p in params] for _, params in groups]
        self.link.begin()
        buckets = []
        for (index, params), group_copies in zip(groups, copies):
            members, size = [], 0
            for p, copy in zip(params, group_copies):
                grad = p.grad
                if copy.grad is None or copy.grad.dtype != grad.dtype:
                    copy.grad = torch.empty(p.shape, dtype=grad.dtype, pin_memory=self.link.pin_memory)
                self.link.download(copy.grad, grad)
                members.append(p)
                size += grad.numel() * grad.element_size()
                if size >= self.bucket_bytes:
                    buckets.append(Bucket(index, members, self.link.downloaded()))
                    members, size = [], 0
            if members:
                buckets.append(Bucket(index, members, self.link.downloaded()))
        return buckets

    def wait(self, bucket: Bucket) -> None:
        """Blocks until the bucket's gradients are in their host buffers."""
        self.link.wait(bucket.mark)

    def upload(self, bucket: Bucket, skipped: set[Tensor] | frozenset = frozenset()) -> None:
        """Queues the upload of the bucket's images into their parameters,
        but for `skipped` ones (not stepped: parameter and image are equal)."""
        for p in bucket.params:
            if p not in skipped:
                self.link.upload(p.detach(), self._copies[p].image)

    def end(self) -> None:
        """Ends the step: the compute stream waits for every copy queued, and
        the next begin() for the uploads. Call it after begin() whatever
        happened in between."""
        self._uploaded = self.link.uploaded()
        self.link.end()
