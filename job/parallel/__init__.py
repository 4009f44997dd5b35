"""Processes and devices: the process group (``distributed``, the only module that creates one) and how the
model is replicated and its gradients communicated (``ddp``: DDP knobs, comm hooks, ZeRO)."""
