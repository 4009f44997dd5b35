"""How a job is started: which launcher started us (``env``), the torchrun drop-in (``torchrun``), Slurm
submission with submitit (``submit``), and the stop protocol every launcher shares (``stop``)."""
