"""Tasks: the training problem (model, data, loss, metrics) behind the job's one training path.

``contract`` is what a task gives the job, ``load`` turns ``task.name`` into one, ``preflight`` checks it
before any process group. The built-in tasks: ``image`` (image classification, the default) and ``lm`` (a
small causal language model).
"""
