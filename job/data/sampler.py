"""Sample order over ranks: one global permutation per epoch, sliced by rank, resumable mid-epoch.

For epoch ``e`` the global order is ``perm_e = randperm(N)`` from a generator seeded with ``(seed, e)``
only; it does not depend on the world size. With ``W`` ranks, micro batch ``m`` and ``A``
gradient-accumulation micro-steps per optimizer step, a "row" is ``W*m`` samples and::

    rank r, micro-batch k of the epoch  = perm_e[k*W*m + r*m : k*W*m + (r+1)*m]
    optimizer step s of the epoch       = perm_e[s*A*W*m : (s+1)*A*W*m]   (its A micro-steps in order)

so one optimizer step always sees the same samples whatever the split between ranks and accumulation
(1 rank x micro 2m, 2 ranks x micro m, or 1 rank x 2 micro-steps of m all see perm_e[0:2m] first).
Unlike torch's DistributedSampler (interleaved stride, padding), ranks take contiguous slices of each
row and the tail that does not fill a whole optimizer step is dropped (``batches_per_epoch`` micro-batches
per rank, a multiple of ``A``), so an optimizer step never straddles two epochs.
``set_position(epoch, start_batch)`` starts the next iteration at micro-batch ``start_batch``: the
remaining batches are exactly those an uninterrupted run would still see. The position is world-size
independent as "samples consumed in the epoch" (``start_batch * W * m``), which is how a resume with a
different world size maps it (job.checkpoint.resume.map_data_position).
Pass the trainer's ``grad_accum_steps``: without it an epoch of ``N // (W*m)`` micro-batches can end in
the middle of an optimizer step, and then W=1 x 2 micro-steps and W=2 x 1 would see different samples.

Validation: `shard_range` gives each rank a disjoint contiguous slice (sizes differ by at most one, no
padding, no duplicates), so sums and counts all-reduced over ranks are exact.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's augmentation: a hash of (seed, epoch, index), independent of workers."""
    return int(np.random.SeedSequence([seed % 2**64, epoch, index]).generate_state(1, np.uint64)[0] >> 1)


COLLATE_KEY = 1
"""The fourth entry of a batch's collate seed: a collate seed never equals an item's augmentation seed."""


def collate_seed(seed: int, epoch: int, first_index: int) -> int:
    """The seed of one batch's ``collate``: a hash of (seed, epoch, the index of the batch's first item).

    The first item names the batch: each index is in one batch of an epoch, on one rank, whatever the workers,
    prefetching or a resume in between (the micro-batch's position would do as well, but only the sampler
    knows it, while the item keys travel with the batch)."""
    state = np.random.SeedSequence([seed % 2**64, epoch, first_index, COLLATE_KEY]).generate_state(1, np.uint64)
    return int(state[0] >> 1)


class ResumableSampler(Sampler):
    """This rank's share of each epoch, as (epoch, index) pairs; layout in the module docstring."""

    def __init__(
        self,
        num_samples: int,
        rank: int,
        world_size: int,
        micro_batch_size: int,
        seed: int,
        grad_accum_steps: int = 1,
        shuffle: bool = True,
    ):
        if not 0 <= rank < world_size or micro_batch_size < 1 or grad_accum_steps < 1:
            raise ValueError(
                f"bad sampler arguments rank={rank} world_size={world_size} "
                f"micro_batch_size={micro_batch_size} grad_accum_steps={grad_accum_steps}"
            )
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.micro_batch_size, self.seed, self.accum, self.shuffle = micro_batch_size, seed, grad_accum_steps, shuffle
        self.row = world_size * micro_batch_size  # samples per micro-step over all ranks
        self.batches_per_epoch = num_samples // (self.row * grad_accum_steps) * grad_accum_steps
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.set_position(epoch, 0)

    def set_position(self, epoch: int, start_batch: int) -> None:
        """The next iteration yields micro-batches start_batch.. of ``epoch`` (0 <= start_batch <= batches_per_epoch)."""
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start_batch={start_batch} outside 0..{self.batches_per_epoch}")
        self.epoch, self.start_batch = epoch, start_batch

    def order(self, epoch: int) -> torch.Tensor:
        """The global sample order of ``epoch`` (same on every rank and world size)."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        # index 2**40 is no sample: the order seed never equals an augmentation seed.
        g = torch.Generator().manual_seed(sample_seed(self.seed, epoch, 2**40))
        return torch.randperm(self.num_samples, generator=g)

    def rank_batches(self, epoch: int) -> torch.Tensor:
        """[batches_per_epoch, micro_batch_size] dataset indices of this rank's micro-batches."""
        rows = self.order(epoch)[: self.batches_per_epoch * self.row].view(-1, self.world_size, self.micro_batch_size)
        return rows[:, self.rank]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        for batch in self.rank_batches(epoch)[self.start_batch :].tolist():
            for index in batch:
                yield epoch, index

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.micro_batch_size


def shard_range(num_samples: int, rank: int, world_size: int) -> range:
    """Rank's contiguous validation shard: sizes differ by at most one, union is exactly 0..N-1."""
    return range(rank * num_samples // world_size, (rank + 1) * num_samples // world_size)


class ShardSampler(Sampler):
    def __init__(self, num_samples: int, rank: int, world_size: int):
        self.indices = shard_range(num_samples, rank, world_size)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((0, i) for i in self.indices)

    def __len__(self) -> int:
        return len(self.indices)
