import os

import pytest

from pipeline_helpers import snakemake, write_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The tiny experiment run once end to end through the real launcher, Ray, DeepSpeed, vLLM and MLflow."""
    root = tmp_path_factory.mktemp("tiny")
    configfile = write_config(root / "tiny.yaml", root / "results")
    proc = snakemake(configfile, "all")
    return {"root": root, "configfile": configfile, "results": root / "results" / "tiny", "proc": proc,
            "mlflow_uri": f"sqlite:///{root / 'results' / 'mlflow.db'}"}
