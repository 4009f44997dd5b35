from job.cli import entrypoint

entrypoint()
