"""alignpipe's stages: one module per stage of the DAG, each a typed `Config` and one entry `run(cfg, inputs,
output, tracker)`. The machinery they share is in runtime/; submission and config checks in launcher/."""
