"""Preflight checks (``ddp-job doctor``): local checks (``checks``), and the run that gathers every
rank's results into one report (``run``)."""
