"""How a job is started: the torchrun drop-in (``torchrun``) and Slurm submission with submitit
(``submit``)."""
