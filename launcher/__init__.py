"""The submitting side of every stage: config validation, code hashes (cache keys), resources and their checks,
submission and watching. Nothing here shapes a stage's result (launcher/code_hash.py)."""
