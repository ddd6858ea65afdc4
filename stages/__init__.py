"""alignpipe stages: one module per pipeline stage (a typed config and a `run` entry) plus shared machinery.

Keep this file free of heavy imports: the Snakefile imports `stages.config` to validate configs in seconds.
"""
