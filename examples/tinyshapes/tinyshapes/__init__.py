"""A user package for ddp-job: a small CNN (tinyshapes.model:tiny_cnn) and a generated dataset
(tinyshapes.data:shapes). Nothing here imports ddp-job: the job calls these by their import paths."""
