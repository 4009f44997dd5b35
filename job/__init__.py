"""ddp-job: one DistributedDataParallel training job for torchvision image models.

Importing ``job`` has no side effects: no environment reads, no CUDA initialisation.
"""

__version__ = "0.1.0"
