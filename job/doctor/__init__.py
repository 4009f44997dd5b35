"""Preflight checks (``ddp-job doctor``): the phases around the process group (``phases``), what one rank
checks alone (``checks``), every rank's facts compared (``consistency``), the collectives checked and timed
(``communication``) and the report (``report``). What it checks of the model and the data is handed to it."""
